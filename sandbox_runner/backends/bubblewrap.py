"""Bubblewrap backend: no daemon, for hosts without Docker.

bwrap runs as uid/gid 1000 on the host too (never as root), in new user,
pid, ipc, uts, net, cgroup and mount namespaces, with further user namespaces
disabled, every capability dropped, no_new_privs (bwrap always sets it) and
--die-with-parent. The root is an empty tmpfs remounted read-only with the
host's /usr bound read-only (the "image" is the host's system directories),
/workspace a tmpfs of the run's scratch_mb (bwrap's own, gone with the
sandbox), /tmp a noexec tmpfs of 64 MiB the runner mounts (a runner that is not
root cannot: bwrap's own tmpfs of the same size, exec allowed, and the record
says so), the script and input bound read-only.

Limits: cgroups (v1 or v2) when the runner may create them, swap capped with memory
where the host accounts for swap (the record says "cgroup (swap not capped)" where it
does not). Else rlimits (RLIMIT_AS,
RLIMIT_NPROC, RLIMIT_CPU), which bind each process, not the run, so only when the
deployment sets SANDBOX_ALLOW_RLIMITS=1 (otherwise the backend is unavailable); the
run record says which per limit.
bwrap is started blocked (--block-fd): the runner records the start, the
sandbox is moved into its cgroups and the egress proxy bound in its network
namespace, and only then is it released, so the code never runs a moment
outside its limits, nor before its start is on record.

Latency (the issue's target is <= 30 ms p50 for a trivial script, authorization
included): the run's cgroups are made, empty, while governance decides, and the
cgroup-move grace period is paid then (prepare()); the started record overlaps
bwrap building its namespaces; one thread (the runner's watch) moves the held
sandbox into its cgroups, pumps both output streams and reaps bwrap.

Seccomp: a small denylist filter (sandbox_runner/seccomp.py, compiled with the
host's libseccomp) blocks mount, namespace, ptrace, keyring, BPF, io_uring, perf and
module calls with EPERM; narrower than Docker's default allowlist profile. The
run record's enforcement says "seccomp": "filter", or why there is none.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sandbox_runner import seccomp
from sandbox_runner.backends.base import Backend, BackendUnavailable, Handle, NetworkHook, Sink
from sandbox_runner.spec import INPUT_PATH, SCRIPT_PATH, Authorization, Limits, RunSpec

UID = GID = 1000
TMP_SIZE = "64m"
_TMP_BYTES = 64 * 1024 * 1024
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Without cgroups, limits are rlimits: per process, so not a ceiling on the run. The
# backend refuses to run so unless the deployment accepts that, by name.
ALLOW_RLIMITS = "SANDBOX_ALLOW_RLIMITS"


def cgroups_usable() -> bool:
    """Can this runner put a run's processes under memory, pids and cpu cgroups? (root,
    and cgroup v2 or the three v1 controllers)."""
    if os.geteuid() != 0:
        return False
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return True
    return all((CGROUP_ROOT / c).is_dir() for c in ("memory", "pids", "cpu"))


CGROUP_NAME = "governance-sandbox"
# The run record's `enforcement.memory` when its RAM is capped by the cgroup but its swap
# could not be (no swap accounting on this host): not a ceiling on all the run's memory.
MEMORY_SWAP_NOT_CAPPED = "cgroup (swap not capped)"
POLL_EXIT = 0.5  # seconds: how often wait() looks whether bwrap exited while streams are open
DRAIN_AFTER_EXIT = 5.0  # seconds of output still read after bwrap exited
# bwrap reads end-of-file on --block-fd as "go": were the runner killed while the
# sandbox is held, the code would run outside its cgroups with nobody watching.
# So the code is started by this gate, which runs it only on an explicit "1" on its
# stdin (written by release()); end-of-file there is exit 125 and nothing else runs.
GATE_EXIT = 125
GATE = f'read -r go && [ "$go" = 1 ] && exec "$@" </dev/null; exit {GATE_EXIT}'


def bwrap_argv(
    workdir: Path, has_script: bool, has_input: bool, scratch_mb: int, tmp_on_host: bool = True
) -> list[str]:
    """The namespace and mount layout (shared with the benchmark's bare bwrap)."""
    argv = [
        "bwrap",
        "--unshare-all",  # ipc, pid, net, uts, cgroup (and user, if it can)
        "--unshare-user",  # required, not "if it can"
        "--disable-userns",  # no nested user namespaces from inside
        "--die-with-parent",
        "--new-session",
        "--uid", str(UID),
        "--gid", str(GID),
        "--hostname", "sandbox",
        "--cap-drop", "ALL",
        "--clearenv",
        "--ro-bind", "/usr", "/usr",
    ]  # fmt: skip
    for name in ("bin", "lib", "lib64", "sbin"):
        if Path(f"/{name}").is_symlink():
            argv += ["--symlink", f"usr/{name}", f"/{name}"]
        elif Path(f"/{name}").is_dir():
            argv += ["--ro-bind", f"/{name}", f"/{name}"]
    argv += ["--dir", "/etc", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    # /dev: bwrap's is a writable tmpfs with no size (half the host's RAM, and not
    # counted by RLIMIT_AS): read-only, with the device nodes still usable, and a
    # /dev/shm of its own capped as /tmp is.
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", str(_TMP_BYTES), "--tmpfs", "/dev/shm"]  # noqa: S108
    argv += ["--remount-ro", "/dev"]
    # /workspace: a tmpfs of scratch_mb made by bwrap in the sandbox's own mount
    # namespace, owned by uid 1000 (never a host directory: a run cannot fill the
    # host's disk), gone with the sandbox.
    argv += ["--perms", "0700", "--size", str(scratch_mb * 1024 * 1024), "--tmpfs", "/workspace"]
    if tmp_on_host:  # the runner's noexec tmpfs (mount_noexec_tmp), of TMP_SIZE
        argv += ["--bind", str(workdir / "tmp"), "/tmp"]  # noqa: S108 - the sandbox's own
    else:  # no root to mount it noexec: bwrap's own tmpfs, still capped
        argv += ["--perms", "1777", "--size", str(_TMP_BYTES), "--tmpfs", "/tmp"]  # noqa: S108
    if has_script:
        argv += ["--ro-bind", str(workdir / "in" / "script"), SCRIPT_PATH]
    if has_input:
        argv += ["--ro-bind", str(workdir / "in" / "input"), INPUT_PATH]
    argv += ["--remount-ro", "/", "--chdir", "/workspace"]
    return argv


_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MNT_DETACH = 2


def mount_noexec_tmp(path: Path) -> bool:
    """A noexec tmpfs for /tmp (root only; mount(2) directly, no mount(8) process).
    False when it cannot be mounted: /tmp is then a plain directory, and the run
    record says so."""
    path.mkdir(exist_ok=True)
    os.chmod(path, 0o1777)  # noqa: S103 - the sandbox's /tmp, like any /tmp
    if os.geteuid() != 0:
        return False
    options = f"mode=1777,size={TMP_SIZE}".encode()
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    return _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", flags, options) == 0


def unmount(path: Path) -> None:
    _libc.umount2(str(path).encode(), MNT_DETACH)


class Cgroups:
    """Per-run cgroups (v2 unified, or the v1 memory, pids and cpu controllers)."""

    def __init__(self, run_id: str) -> None:
        self.dirs: dict[str, Path] = {}
        self.run_id = run_id

    def make(self) -> None:
        """Make the run's groups, empty and without limits yet (no process is in
        them until limit() has set every limit). Errors are not raised: a group
        that could not be made (or exists already: see _make) is a limit that falls
        back to an rlimit."""
        if os.geteuid() != 0:
            return
        with contextlib.suppress(OSError):
            if (CGROUP_ROOT / "cgroup.controllers").exists():
                # Untested here (this host is cgroup v1): delegate the controllers down.
                for parent in (CGROUP_ROOT, CGROUP_ROOT / CGROUP_NAME):
                    parent.mkdir(exist_ok=True)
                    self._write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
                self._make("unified", CGROUP_ROOT)
                return
        for key in ("memory", "pids", "cpu"):
            with contextlib.suppress(OSError):
                self._make(key, CGROUP_ROOT / key)

    def limit(self, limits: Limits) -> dict[str, str]:
        """Set the limits (making any group make() did not); returns how each
        limit is enforced."""
        if os.geteuid() != 0:
            return {}
        enforced: dict[str, str] = {}
        memory = str(limits.memory_mb * 1024 * 1024)
        period = 100_000
        quota = str(max(1000, int(limits.cpus * period)))
        if "unified" in self.dirs:
            with contextlib.suppress(OSError):
                d = self.dirs["unified"]
                self._write(d / "memory.max", memory)
                swap = self._cap_swap(d / "memory.swap.max", "0")
                self._write(d / "pids.max", str(limits.pids))
                self._write(d / "cpu.max", f"{quota} {period}")
                return {"memory": swap, "pids": "cgroup", "cpus": "cgroup"}
        with contextlib.suppress(OSError):
            d = self._make("memory", CGROUP_ROOT / "memory")
            self._write(d / "memory.limit_in_bytes", memory)
            # memory + swap together, at the same size: no swap beyond RAM's cap.
            enforced["memory"] = self._cap_swap(d / "memory.memsw.limit_in_bytes", memory)
        with contextlib.suppress(OSError):
            d = self._make("pids", CGROUP_ROOT / "pids")
            self._write(d / "pids.max", str(limits.pids))
            enforced["pids"] = "cgroup"
        with contextlib.suppress(OSError):
            d = self._make("cpu", CGROUP_ROOT / "cpu")
            self._write(d / "cpu.cfs_period_us", str(period))
            self._write(d / "cpu.cfs_quota_us", quota)
            enforced["cpus"] = "cgroup"
        return enforced

    def _cap_swap(self, path: Path, value: str) -> str:
        """How memory is enforced once `path` (the swap cap) is written, or not: without
        swap accounting (no memory.memsw.* on v1, no memory.swap.max on v2) RAM is capped
        but the run may go on in swap past memory_mb, and the record says so."""
        try:
            self._write(path, value)
        except OSError:
            return MEMORY_SWAP_NOT_CAPPED
        return "cgroup"

    def _make(self, key: str, root: Path) -> Path:
        if not root.is_dir():
            raise OSError(f"no cgroup hierarchy at {root}")
        d = self.dirs.get(key) or root / CGROUP_NAME / self.run_id
        if key not in self.dirs:
            # Made here or not used: a group that already exists is another run's (the
            # same run id, refused by governance as a duplicate), and what this run
            # holds it removes, killing every process in it.
            d.parent.mkdir(parents=True, exist_ok=True)
            d.mkdir()
            self.dirs[key] = d
        return d

    @staticmethod
    def _write(path: Path, value: str) -> None:
        path.write_text(value)

    def add(self, pid: int) -> None:
        for d in self.dirs.values():
            self._write(d / "cgroup.procs", str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs.values():
            with contextlib.suppress(OSError):
                found |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
        return found

    def oom_killed(self) -> bool:
        # v1: the memory group's memory.oom_control; v2: the group's memory.events.
        for key, name in (("memory", "memory.oom_control"), ("unified", "memory.events")):
            if key in self.dirs:
                with contextlib.suppress(OSError, ValueError):
                    for line in (self.dirs[key] / name).read_text().splitlines():
                        counter, _, value = line.partition(" ")
                        if counter == "oom_kill" and int(value) > 0:
                            return True
        return False

    def kill(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        for d in self.dirs.values():
            for attempt in range(50):
                try:
                    d.rmdir()  # fails while any process is left in the group
                    break
                except OSError:  # not empty yet: kill what is left, give it a moment
                    self.kill()
                    if attempt:
                        threading.Event().wait(0.02)


# How each rlimit binds, as the run record says: none of them is a ceiling on the run.
RLIMIT_ENFORCEMENT = {
    "memory": "rlimit (per process)",
    "pids": "rlimit (per user)",
    "cpus": "rlimit (cpu seconds per process)",
}


def _rlimits(limits: Limits, missing: set[str]) -> None:
    """The fallback for what cgroups could not enforce (inherited by bwrap's children),
    only with SANDBOX_ALLOW_RLIMITS=1 (see unavailable())."""
    if "memory" in missing:
        size = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    if "pids" in missing:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.pids, limits.pids))
    if "cpus" in missing:
        seconds = max(1, int(limits.cpus * limits.wall_seconds) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))


class BubblewrapHandle(Handle):
    """One bwrap sandbox, started blocked (--block-fd): release() lets the code run."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        cgroups: Cgroups,
        workdir: Path,
        info_fd: int,
        go_fds: tuple[int, int],
        network: NetworkHook,
        sinks: tuple[Sink, Sink],
    ) -> None:
        self.proc = proc
        self.cgroups = cgroups
        self.workdir = workdir
        self.container_id = f"bwrap:{proc.pid}"
        self.image_digest = "host:/usr"
        self.enforcement: dict[str, str] = {}
        self._info_fd: int | None = info_fd
        # bwrap's --block-fd and the gate's stdin: both say "go" in release().
        self._block_fd: int | None = go_fds[0]
        self._gate_fd: int | None = go_fds[1]
        self._network = network
        self._sinks = sinks
        self._child: int | None = None
        self._admitted = False
        self._lock = threading.Lock()  # the info pipe and the cgroup move, once

    def _sandbox_pid(self) -> int | None:
        """The sandbox's first process (bwrap writes it to --info-fd right after
        clone(), before the namespace is set up); None if bwrap ended without one.
        Called with self._lock held."""
        if self._info_fd is not None:
            raw = b""
            try:
                while b"}" not in raw and (chunk := os.read(self._info_fd, 4096)):
                    raw += chunk
            finally:
                os.close(self._info_fd)
                self._info_fd = None
            if b"}" in raw:
                self._child = int(json.loads(raw[: raw.index(b"}") + 1])["child-pid"])
        return self._child

    def _admit(self) -> int:
        """Move the sandbox into its cgroups, once, from whichever thread comes
        first: the runner's watch (wait(), while the runner records the start) or
        release(). The code is still blocked either way."""
        with self._lock:
            child = self._sandbox_pid()
            if child is None:
                raise RuntimeError("bwrap exited before it made the sandbox")
            if not self._admitted:
                self.cgroups.add(child)
                self._admitted = True
            return child

    def release(self) -> None:
        child = self._admit()
        if self._network is not None:
            self._network(child)
        assert self._block_fd is not None and self._gate_fd is not None
        os.write(self._block_fd, b"1")  # go: limits and network are in place
        os.write(self._gate_fd, b"1\n")  # and the gate runs the code
        os.close(self._block_fd)
        os.close(self._gate_fd)
        self._block_fd = self._gate_fd = None

    def wait(self) -> int | None:
        """Pump stdout and stderr to their sinks until both close (the sandbox's
        processes all die with its pid namespace), then reap bwrap. One thread
        (the runner's watch) for both streams: no reader threads to start. Before
        that, while the sandbox is still held, it moves it into its cgroups (the
        move can wait for an RCU grace period; here that overlaps the runner's
        record of the start instead of following it). Errors there are left to
        release(), which tries again and fails the run."""
        if self._block_fd is not None:
            with contextlib.suppress(Exception):
                self._admit()
        streams = [s for s in (self.proc.stdout, self.proc.stderr) if s is not None]
        with selectors.DefaultSelector() as selector:
            for stream, sink in zip(streams, self._sinks, strict=True):
                selector.register(stream, selectors.EVENT_READ, sink)
            exited_at: float | None = None
            while selector.get_map():
                for key, _ in selector.select(timeout=POLL_EXIT):
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        key.data(chunk)
                    else:
                        selector.unregister(key.fileobj)
                if exited_at is None and self.proc.poll() is not None:
                    exited_at = time.monotonic()
                if exited_at is not None and time.monotonic() - exited_at > DRAIN_AFTER_EXIT:
                    break  # bwrap is gone but something still holds a stream open
        code = self.proc.wait()
        return 128 - code if code < 0 else code

    def kill(self) -> None:
        # bwrap's child is pid 1 of its namespace and dies with it (--die-with-parent);
        # everything in the run's cgroups is killed too, in case it escaped that.
        with contextlib.suppress(OSError):
            self.proc.send_signal(signal.SIGKILL)
        if self._block_fd is not None:
            # Never released: bwrap's sandbox process sets --die-with-parent only just
            # before it runs the code, and reads end-of-file on the block pipe as "go".
            # It dies here, by pid, before that pipe is ever closed (cleanup()).
            with self._lock:  # bwrap itself is dead or dying: no wait
                child = self._sandbox_pid()
            if child is not None:
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
        self.cgroups.kill()

    def oom_killed(self) -> bool:
        return self.cgroups.oom_killed()

    def cleanup(self) -> None:
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self._block_fd is not None:  # killed before release(): nothing left to let go
            os.close(self._block_fd)
            self._block_fd = None
        if self._gate_fd is not None:  # end-of-file: the gate exits, the code never ran
            os.close(self._gate_fd)
            self._gate_fd = None
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
        self.cgroups.remove()
        unmount(self.workdir / "tmp")


class BubblewrapBackend(Backend):
    name = "bubblewrap"

    def __init__(self) -> None:
        self._prepared: threading.Event | None = None
        self._cgroups: Cgroups | None = None
        self._tmp: Path | None = None

    def workdir_owner(self) -> int | None:
        return UID if os.geteuid() == 0 else None  # bwrap runs as UID, never as root

    def unavailable(self) -> str | None:
        if shutil.which("bwrap") is None:
            return "bwrap is not installed (apt-get install bubblewrap)"
        if not cgroups_usable() and os.environ.get(ALLOW_RLIMITS) != "1":
            return (
                "bubblewrap without cgroups could only set rlimits, which bind each "
                "process, not the run (a fork multiplies the memory and CPU caps): run the "
                "runner as root on a host with cgroups, use the docker backend, or set "
                f"{ALLOW_RLIMITS}=1 to accept per-process limits"
            )
        return None

    def image_id(self, image: str) -> str:
        return ""  # no image: the host's /usr, read-only, is what runs

    def prepare(self, spec: RunSpec) -> Callable[[], None]:
        """While governance decides: make the run's cgroups, empty and without
        limits (no process enters them before start() has set every limit, and a
        refused run's are removed by discard()), then pay the cgroup-move grace
        period (see _prewarm). Nothing is started.

        The directories come first because making one takes the cgroup lock that
        the grace period then holds for its whole length (~1-10 ms here)."""
        made = self._prepared = threading.Event()

        def work() -> None:
            try:
                cgroups = Cgroups(spec.run_id)
                cgroups.make()
                self._cgroups = cgroups
            finally:
                made.set()
            _prewarm()

        return work

    def discard(self) -> None:
        if self._prepared is not None:
            self._prepared.wait()
        if self._cgroups is not None:
            self._cgroups.remove()
        if self._tmp is not None:
            unmount(self._tmp)

    def start(
        self,
        spec: RunSpec,
        auth: Authorization,
        workdir: Path,
        deadline: float,
        on_stdout: Sink,
        on_stderr: Sink,
        network: NetworkHook,
    ) -> Handle:
        """bwrap, started blocked: the returned handle's release() puts the sandbox in
        its cgroups, binds the egress proxy in its network namespace, then lets it
        go, so the code never runs a moment outside its limits (and the runner
        records the start before it runs at all)."""
        assert auth.limits is not None
        limits = auth.limits
        self._tmp = workdir / "tmp"
        tmp_noexec = mount_noexec_tmp(self._tmp)
        if self._prepared is not None:
            self._prepared.wait()  # the directories only (not the grace period)
        cgroups = self._cgroups or Cgroups(spec.run_id)
        self._cgroups = cgroups
        enforcement = cgroups.limit(limits)
        missing = {"memory", "pids", "cpus"} - set(enforcement)
        if missing and os.environ.get(ALLOW_RLIMITS) != "1":
            # unavailable() found the hierarchy, but a group could not be limited now.
            raise BackendUnavailable(
                f"cgroups could not limit {', '.join(sorted(missing))} for this run, and "
                f"rlimits are per process ({ALLOW_RLIMITS} is not set): nothing was started"
            )
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        argv = bwrap_argv(
            workdir, spec.script is not None, spec.input is not None, limits.scratch_mb, tmp_noexec
        )
        env = {"HOME": "/workspace", "TMPDIR": "/tmp", "SANDBOX_RUN_ID": spec.run_id}  # noqa: S108
        env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
        if spec.input is not None:
            env["SANDBOX_INPUT"] = INPUT_PATH
        if network is not None:
            for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
                env[name] = "http://127.0.0.1:3128"
        for key, value in env.items():
            argv += ["--setenv", key, value]
        seccomp_fd = seccomp.program_fd()
        fds = [info_w, block_r]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
            fds.append(seccomp_fd)
        argv += ["--info-fd", str(info_w), "--block-fd", str(block_r)]
        argv += ["--", "/bin/sh", "-c", GATE, "sandbox-gate", *spec.command]
        gate_r, gate_w = os.pipe()

        as_root = os.geteuid() == 0
        setpriv = shutil.which("setpriv")

        def preexec() -> None:
            _rlimits(limits, missing)
            if as_root:  # never run bwrap as root: uid 1000 outside the sandbox too
                os.setgroups([])
                os.setgid(GID)
                os.setuid(UID)

        launcher: list[str] = []
        child_setup: object = preexec
        if not missing and (setpriv or not as_root):
            # Nothing to set in the child but the uid: setpriv(1) drops root before it
            # execs bwrap, so Popen needs no preexec_fn and can vfork the runner's (large)
            # process instead of copying it with fork (~15 ms under load).
            if as_root:
                launcher = [setpriv, "--reuid", str(UID), "--regid", str(GID), "--clear-groups"]
                launcher.append("--")
            child_setup = None
        try:
            proc = subprocess.Popen(  # noqa: S603 - argv built here, no shell
                [*launcher, *argv],
                stdin=gate_r,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=tuple(fds),
                preexec_fn=child_setup,  # type: ignore[arg-type]  # noqa: PLW1509
                env={"PATH": "/usr/bin:/bin"},
            )
        except BaseException:
            os.close(info_r)
            os.close(block_w)
            os.close(gate_w)
            raise
        finally:
            for fd in (*fds, gate_r):
                os.close(fd)
        handle = BubblewrapHandle(
            proc, cgroups, workdir, info_r, (block_w, gate_w), network, (on_stdout, on_stderr)
        )
        self._cgroups = self._tmp = None  # the handle's to clean from here on
        handle.enforcement = {
            **enforcement,
            **{k: RLIMIT_ENFORCEMENT[k] for k in missing},
            "wall_seconds": "runner",
            "seccomp": "filter" if seccomp_fd is not None else "none (no libseccomp)",
            "tmp": "noexec tmpfs" if tmp_noexec else "bwrap tmpfs (exec allowed: not root)",
            "scratch": "bwrap tmpfs",
        }
        return handle


def _prewarm() -> None:
    """The first move of a process into a cgroup after a quiet spell waits for an
    RCU grace period (cgroup v1 here: 5-10 ms, more under load, holding the cgroup
    lock; fork/clone stall behind it). Moving the runner into the cgroup it is
    already in pays that wait in a thread while governance decides and bwrap builds
    its namespaces; the sandbox's own move, right after, is then cheap. Nothing
    else changes: the runner stays where it was."""
    if os.geteuid() != 0:
        return
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers in ("pids", ""):  # v1 pids, or the v2 unified hierarchy
                base = CGROUP_ROOT / "pids" if controllers else CGROUP_ROOT
                procs = base / path.lstrip("/") / "cgroup.procs"
                if procs.exists():
                    procs.write_text(str(os.getpid()))
                    return


def _kill_processes_of(run_id: str) -> int:
    """SIGKILL every process whose command line names this run (bwrap's own
    `--setenv SANDBOX_RUN_ID <id>`): a sandbox its runner left before moving it into
    its cgroups (held, or stuck in bwrap's setup) is in no cgroup to kill it by."""
    marker = f"SANDBOX_RUN_ID\0{run_id}\0".encode()
    killed = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return killed


def clean_orphan(run_id: str, workdir_root: Path) -> None:
    """What a runner killed mid-run leaves behind (its sandbox died with it,
    --die-with-parent): any process of the run, in its cgroups or not yet, is
    killed, the cgroups removed, the /tmp mount undone, the work directory deleted."""
    _kill_processes_of(run_id)
    cgroups = Cgroups(run_id)
    for key, parent in (
        ("unified", CGROUP_ROOT),
        *((c, CGROUP_ROOT / c) for c in ("memory", "pids", "cpu")),
    ):
        d = parent / CGROUP_NAME / run_id
        if d.is_dir():
            cgroups.dirs[key] = d
    cgroups.remove()
    for workdir in workdir_root.glob(f"run-{run_id}-*"):
        unmount(workdir / "tmp")
        shutil.rmtree(workdir, ignore_errors=True)
