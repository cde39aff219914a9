"""Bubblewrap backend: no daemon, for hosts without Docker.

bwrap runs as uid/gid 1000 on the host too (never as root), in new user,
pid, ipc, uts, net, cgroup and mount namespaces, with further user namespaces
disabled, every capability dropped, no_new_privs (bwrap always sets it) and
--die-with-parent. The root is an empty tmpfs remounted read-only with the
host's /usr bound read-only (the "image" is the host's system directories),
/workspace the per-run scratch directory, /tmp a noexec tmpfs the runner
mounts, the script and input bound read-only.

Limits: cgroups (v1 or v2) when the runner may create them, else rlimits
(RLIMIT_AS, RLIMIT_NPROC, RLIMIT_CPU); the run record says which per limit.
bwrap is started blocked (--block-fd): the runner moves the sandbox into its
cgroups and binds the egress proxy in its network namespace first, so the
code never runs a moment outside its limits.

Seccomp: a small denylist filter (sandbox_runner/seccomp.py, compiled with the
host's libseccomp) blocks mount, namespace, ptrace, keyring, BPF, perf and
module calls with EPERM; narrower than Docker's default allowlist profile. The
run record's enforcement says "seccomp": "filter", or why there is none.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from sandbox_runner import seccomp
from sandbox_runner.backends.base import Backend, Handle, NetworkHook, Sink
from sandbox_runner.spec import INPUT_PATH, SCRIPT_PATH, Authorization, Limits, RunSpec

UID = GID = 1000
TMP_SIZE = "64m"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_NAME = "governance-sandbox"


def bwrap_argv(workdir: Path, has_script: bool, has_input: bool) -> list[str]:
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
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--bind", str(workdir / "scratch"), "/workspace"]
    argv += ["--bind", str(workdir / "tmp"), "/tmp"]  # noqa: S108 - the sandbox's own noexec tmpfs
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

    def create(self, limits: Limits) -> dict[str, str]:
        """Make the groups and set limits; returns how each limit is enforced."""
        if os.geteuid() != 0:
            return {}
        enforced: dict[str, str] = {}
        memory = str(limits.memory_mb * 1024 * 1024)
        period = 100_000
        quota = str(max(1000, int(limits.cpus * period)))
        v2 = CGROUP_ROOT / "cgroup.controllers"
        with contextlib.suppress(OSError):
            if v2.exists():
                # Untested here (this host is cgroup v1): delegate the controllers down.
                for parent in (CGROUP_ROOT, CGROUP_ROOT / CGROUP_NAME):
                    parent.mkdir(exist_ok=True)
                    self._write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
                d = self._make("unified", CGROUP_ROOT)
                self._write(d / "memory.max", memory)
                self._write(d / "memory.swap.max", "0")
                self._write(d / "pids.max", str(limits.pids))
                self._write(d / "cpu.max", f"{quota} {period}")
                return {"memory": "cgroup", "pids": "cgroup", "cpus": "cgroup"}
        with contextlib.suppress(OSError):
            d = self._make("memory", CGROUP_ROOT / "memory")
            self._write(d / "memory.limit_in_bytes", memory)
            with contextlib.suppress(OSError):  # only with swap accounting
                self._write(d / "memory.memsw.limit_in_bytes", memory)
            enforced["memory"] = "cgroup"
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

    def _make(self, key: str, root: Path) -> Path:
        if not root.is_dir():
            raise OSError(f"no cgroup hierarchy at {root}")
        d = root / CGROUP_NAME / self.run_id
        d.mkdir(parents=True, exist_ok=True)
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
        for d in self.dirs.values():
            for name in ("memory.oom_control", "memory.events"):
                with contextlib.suppress(OSError, ValueError):
                    for line in (d / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill" and int(value) > 0:
                            return True
        return False

    def remove(self) -> None:
        for d in self.dirs.values():
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    threading.Event().wait(0.02)


def _rlimits(limits: Limits, missing: set[str]) -> dict[str, str]:
    """The fallback for what cgroups could not enforce (inherited by bwrap's children)."""
    done: dict[str, str] = {}
    if "memory" in missing:
        size = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
        done["memory"] = "rlimit"
    if "pids" in missing:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.pids, limits.pids))
        done["pids"] = "rlimit"
    if "cpus" in missing:
        seconds = max(1, int(limits.cpus * limits.wall_seconds) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))
        done["cpus"] = "rlimit (cpu seconds)"
    return done


class BubblewrapHandle(Handle):
    def __init__(self, proc: subprocess.Popen[bytes], cgroups: Cgroups, workdir: Path) -> None:
        self.proc = proc
        self.cgroups = cgroups
        self.workdir = workdir
        self.container_id = f"bwrap:{proc.pid}"
        self.image_digest = "host:/usr"
        self.enforcement: dict[str, str] = {}
        self.readers: list[threading.Thread] = []

    def wait(self) -> int | None:
        code = self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=5)
        return 128 - code if code < 0 else code

    def kill(self) -> None:
        # bwrap's child is pid 1 of its namespace and dies with it (--die-with-parent);
        # everything in the run's cgroups is killed too, in case it escaped that.
        with contextlib.suppress(OSError):
            self.proc.send_signal(signal.SIGKILL)
        for pid in self.cgroups.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def oom_killed(self) -> bool:
        return self.cgroups.oom_killed()

    def cleanup(self) -> None:
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.cgroups.remove()
        unmount(self.workdir / "tmp")


class BubblewrapBackend(Backend):
    name = "bubblewrap"

    def unavailable(self) -> str | None:
        if shutil.which("bwrap") is None:
            return "bwrap is not installed (apt-get install bubblewrap)"
        return None

    def prewarm(self) -> None:
        """The first move of a process into a cgroup after a quiet spell waits for an
        RCU grace period (cgroup v1 here: ~10 ms under load, and fork/clone stall
        behind it). Moving the runner into the cgroup it is already in pays that
        wait in a thread while the runner prepares and bwrap builds its namespaces;
        the sandbox's own move, right after, is then cheap. Nothing else changes:
        the runner stays where it was."""
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
        assert auth.limits is not None
        limits = auth.limits
        tmp_noexec = mount_noexec_tmp(workdir / "tmp")
        cgroups = Cgroups(spec.run_id)
        enforcement = cgroups.create(limits)
        missing = {"memory", "pids", "cpus"} - set(enforcement)
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        argv = bwrap_argv(workdir, spec.script is not None, spec.input is not None)
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
        argv += ["--info-fd", str(info_w), "--block-fd", str(block_r), "--", *spec.command]

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
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=tuple(fds),
                preexec_fn=child_setup,  # type: ignore[arg-type]  # noqa: PLW1509
                env={"PATH": "/usr/bin:/bin"},
            )
        finally:
            for fd in fds:
                os.close(fd)
        handle = BubblewrapHandle(proc, cgroups, workdir)
        try:
            with os.fdopen(info_r, "rb") as info:
                raw = b""
                while b"}" not in raw:
                    chunk = info.read1(4096)
                    if not chunk:
                        break
                    raw += chunk
            child = int(json.loads(raw[: raw.index(b"}") + 1])["child-pid"])
            cgroups.add(child)
            if network is not None:
                network(child)
        except Exception:
            os.close(block_w)
            handle.cleanup()
            raise
        handle.enforcement = {
            **enforcement,
            **{k: "rlimit" for k in missing},
            "wall_seconds": "runner",
            "seccomp": "filter" if seccomp_fd is not None else "none (no libseccomp)",
            "tmp": "noexec tmpfs" if tmp_noexec else "plain directory (exec allowed)",
        }
        for stream, sink in ((proc.stdout, on_stdout), (proc.stderr, on_stderr)):
            reader = threading.Thread(target=_pump, args=(stream, sink), daemon=True)
            reader.start()
            handle.readers.append(reader)
        os.write(block_w, b"1")  # go: limits and network are in place
        os.close(block_w)
        return handle


def _pump(stream: object, sink: Sink) -> None:
    read = stream.read1  # type: ignore[attr-defined]
    while chunk := read(65536):
        sink(chunk)


def clean_orphan(run_id: str, workdir_root: Path) -> None:
    """What a runner killed mid-run leaves behind (its sandbox died with it,
    --die-with-parent): any process still in the run's cgroups is killed, the
    cgroups removed, the /tmp mount undone, the work directory deleted."""
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
