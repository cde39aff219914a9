"""Docker backend: one hardened container per run, through the docker SDK.

The flags are the floor from DESIGN.md, not a menu: no network (or, with
egress, only the namespace of a holder container where the runner's proxy
listens on 127.0.0.1), read-only root, /workspace a tmpfs of the run's
scratch_mb (never a host directory), a noexec tmpfs /tmp, the script and input
mounted read-only, memory with no extra swap, cpus, pids, uid 1000, every
capability dropped, no-new-privileges and the engine's default seccomp profile
(never `seccomp=unconfined`), and no engine log (the output comes through the
attach stream only). No Docker socket and no host path beyond those mounts.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from sandbox_runner.backends.base import (
    LABEL_AGENT,
    LABEL_DEADLINE,
    LABEL_ROLE,
    LABEL_RUN,
    LABEL_WORKDIR,
    Backend,
    BackendUnavailable,
    Handle,
    NetworkHook,
    Sink,
)
from sandbox_runner.spec import INPUT_PATH, SCRIPT_PATH, Authorization, Limits, RunSpec

PROXY_PORT = 3128
TMP_SIZE = "64m"

log = logging.getLogger(__name__)


def scratch_options(limits: Limits) -> str:
    """/workspace: the run's one writable directory, a tmpfs of scratch_mb owned by
    uid 1000 (never a host directory: a run cannot fill the host's disk)."""
    return f"rw,nosuid,nodev,size={limits.scratch_mb}m,uid=1000,gid=1000,mode=0700"


def hardening(limits: Limits) -> dict[str, Any]:
    """The container options every sandbox (and the network holder) gets.

    Also used by the benchmark's bare `docker run`, so both start the same thing.
    """
    memory = f"{limits.memory_mb}m"
    return {
        "read_only": True,
        "tmpfs": {
            "/tmp": f"rw,noexec,nosuid,nodev,size={TMP_SIZE}",  # noqa: S108
            "/workspace": scratch_options(limits),
        },
        "mem_limit": memory,
        "memswap_limit": memory,  # swap equal to memory: no extra swap
        "nano_cpus": int(limits.cpus * 1e9),
        "pids_limit": limits.pids,
        "user": "1000:1000",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "ipc_mode": "private",
        # Its own cgroup namespace: on a cgroup v1 host the engine's default is the
        # host's, and /proc/self/cgroup then shows the host's cgroup paths (the
        # engine's layout, the container's id, the runner's own slice).
        "cgroupns": "private",
        # No engine log: the runner reads the output from the attach stream and keeps
        # OUTPUT_CAP bytes of it; the engine's default json-file log kept every byte the
        # code wrote, without limit, on the host's disk.
        "log_config": {"type": "none"},
    }


def labels(spec: RunSpec, deadline: float, workdir: Path, role: str) -> dict[str, str]:
    return {
        LABEL_RUN: spec.run_id,
        LABEL_DEADLINE: f"{deadline:.3f}",
        LABEL_AGENT: spec.agent,
        LABEL_WORKDIR: str(workdir),
        LABEL_ROLE: role,
    }


NEVER_STARTED = "0001-01-01T00:00:00Z"


def start_container(container: Any) -> None:
    """Start a created container.

    Under load the engine can answer a start with 500 "cannot start an already running
    container" although the start happened (an engine race; seen in CI, cf. moby#41296):
    the container runs, or has run. That is no failure to report: the engine's own state
    decides. A container it says never started is still the error.
    """
    import docker.errors

    try:
        container.start()
    except docker.errors.APIError as error:
        if "already running" not in str(error):
            raise
        container.reload()
        state = container.attrs.get("State") or {}
        if not state.get("Running") and state.get("StartedAt", NEVER_STARTED) == NEVER_STARTED:
            raise


class DockerHandle(Handle):
    def __init__(
        self,
        container: Any,
        holder: Any | None,
        network: NetworkHook,
        enforcement: dict[str, str],
    ) -> None:
        self.container = container
        # Created, not started, like the sandbox: nothing from the run's image runs
        # before the start is on record.
        self.holder = holder
        self._network = network
        self.container_id = container.id
        self.image_digest = container.attrs.get("Image", "")
        self.enforcement = enforcement
        self.reader: threading.Thread | None = None
        # Created, not started: release() starts it once the runner has recorded the
        # start. Until then there is nothing to wait for (a created container would
        # "exit" at once with status 0).
        self._released = threading.Event()
        self._ran = False

    def release(self) -> None:
        try:
            if self.holder is not None:
                # The holder's empty network namespace exists once it runs; the
                # runner's proxy is bound in it before the sandbox joins it.
                start_container(self.holder)
                self.holder.reload()
                assert self._network is not None
                self._network(int(self.holder.attrs["State"]["Pid"]))
            start_container(self.container)
            self._ran = True
        finally:
            self._released.set()

    def wait(self) -> int | None:
        import docker.errors

        self._released.wait()
        if not self._ran:
            return None  # never started (its start could not be recorded, or failed)
        try:
            status = self.container.wait()
        except docker.errors.NotFound:
            return None  # removed under us (the reaper): no exit status to report
        if self.reader is not None:
            # The attach stream ends with the container; join so no output is lost.
            self.reader.join(timeout=5)
        return int(status.get("StatusCode", -1))

    def kill(self) -> None:
        self._released.set()  # killed before release(): it never runs, wait() returns
        try:
            self.container.kill()  # SIGKILL
        except Exception:  # noqa: S110 - already gone is fine: the wait returns anyway
            pass

    def oom_killed(self) -> bool:
        import docker.errors

        try:
            self.container.reload()
        except docker.errors.NotFound:
            return False  # removed by the reaper; it records why
        return bool(self.container.attrs["State"].get("OOMKilled"))

    def cleanup(self) -> None:
        self._released.set()
        for item in (self.container, self.holder):
            if item is None:
                continue
            try:
                item.remove(force=True, v=True)
            except Exception:  # noqa: S110 - the reaper removes anything left behind
                pass


_shared: dict[str, Any] = {}


def shared_client() -> Any:
    """One engine client (and its connection pool) per process: a long-lived runner
    or a benchmark does not pay a new connection and a ping for every run."""
    if "client" not in _shared:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
        _shared["client"] = client
    return _shared["client"]


class DockerBackend(Backend):
    name = "docker"
    runtime: str | None = None  # the engine's default (runc)
    # How each limit is enforced, as the run record says.
    enforcement = {
        "memory": "docker",
        "cpus": "docker",
        "pids": "docker",
        "wall_seconds": "runner",
        "scratch": "docker tmpfs",
    }

    def __init__(self, client: Any = None) -> None:
        self._client = client
        self._checked: str | None = None  # the image id image_id() resolved and checked

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = shared_client()
        return self._client

    def unavailable(self) -> str | None:
        try:
            self.client  # noqa: B018 - connects and pings once per process
        except Exception as exc:
            return f"no Docker engine answers ({type(exc).__name__}: {exc})"
        if self.runtime is not None:
            runtimes = _shared.get("runtimes")
            if runtimes is None:
                runtimes = _shared["runtimes"] = set(self.client.info().get("Runtimes", {}))
            if self.runtime not in runtimes:
                return f"the engine has no {self.runtime!r} runtime registered"
        return None

    def image_id(self, image: str) -> str:
        self._checked = self._image(image)
        return self._checked

    def _image(self, ref: str) -> str:
        """The id of the image `ref` (a name or an id) names now. An image that declares
        a VOLUME is refused: the engine would mount an anonymous volume there, a
        writable host directory outside the read-only root and the scratch limit."""
        import docker.errors

        try:
            image = self.client.images.get(ref)
        except docker.errors.ImageNotFound as exc:
            raise BackendUnavailable(
                f"image {ref!r} is not on this engine; build it with scripts/build_sandbox_image.sh"
            ) from exc
        volumes = sorted((image.attrs.get("Config") or {}).get("Volumes") or {})
        if volumes:
            raise BackendUnavailable(
                f"image {ref!r} declares VOLUME {', '.join(volumes)}: refused (a volume "
                "is a writable host directory outside the read-only root and the scratch "
                "limit)"
            )
        return str(image.id)

    def _authorized_image(self, spec: RunSpec) -> str:
        """The image the decision bound (spec.image_id), by id: what runs is what was
        allowed (and approved), even if the name was moved to other bytes since. An id
        this backend resolved and checked itself is not asked for again (an image's
        configuration, VOLUMEs included, is fixed by its id)."""
        if not spec.image_id:
            raise BackendUnavailable(f"no image id was bound for {spec.image!r}: not started")
        if spec.image_id == self._checked:
            return spec.image_id
        return self._image(spec.image_id)

    def _holder(self, image: str, spec: RunSpec, workdir: Path, deadline: float) -> Any:
        """A do-nothing container whose empty network namespace the sandbox
        joins; the runner's proxy listens inside it on 127.0.0.1. Only created
        here: the handle's release() starts it, after the start is on record."""
        tiny = Limits(memory_mb=16, cpus=0.1, pids=4, wall_seconds=0, scratch_mb=1)
        return self.client.containers.create(
            image,
            # The entrypoint too: an image's own ENTRYPOINT would run (with these as its
            # arguments), its output uncaptured.
            entrypoint=["sleep", "infinity"],
            network_mode="none",
            labels=labels(spec, deadline, workdir, "holder"),
            **hardening(tiny),
        )

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
        image = self._authorized_image(spec)
        volumes: dict[str, dict[str, str]] = {}
        if spec.script is not None:
            volumes[str(workdir / "in" / "script")] = {"bind": SCRIPT_PATH, "mode": "ro"}
        if spec.input is not None:
            volumes[str(workdir / "in" / "input")] = {"bind": INPUT_PATH, "mode": "ro"}
        environment = {
            "HOME": "/workspace",
            "TMPDIR": "/tmp",  # noqa: S108 - the sandbox's own noexec tmpfs
            "SANDBOX_RUN_ID": spec.run_id,
        }
        if spec.input is not None:
            environment["SANDBOX_INPUT"] = INPUT_PATH
        holder = None
        network_mode = "none"
        options = hardening(auth.limits)
        if self.runtime is not None:
            if network is not None:
                # runsc runs with --network=none: its own network stack cannot see the
                # proxy in a shared namespace. Refuse rather than run with less.
                raise BackendUnavailable(f"egress is not supported under {self.runtime}")
            options["runtime"] = self.runtime
        container = None
        try:
            if network is not None:
                holder = self._holder(image, spec, workdir, deadline)
                network_mode = f"container:{holder.id}"
                proxy = f"http://127.0.0.1:{PROXY_PORT}"
                for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
                    environment[name] = proxy
            container = self.client.containers.create(
                image,
                list(spec.command),
                network_mode=network_mode,
                volumes=volumes,
                working_dir="/workspace",
                environment=environment,
                labels=labels(spec, deadline, workdir, "sandbox"),
                **options,
            )
            # Attach before start so not a byte is missed (what `docker run` does); demux
            # keeps stdout and stderr apart. No logs=True: replaying the log while also
            # streaming can deliver the same bytes twice, and before start there is none.
            stream = container.attach(stdout=True, stderr=True, stream=True, logs=False, demux=True)
        except Exception:
            # Nothing of a run that did not start stays on the engine (only the reaper,
            # at its deadline, would find it); a failed removal does not hide why.
            for made in (container, holder):
                if made is not None:
                    try:
                        made.remove(force=True)
                    except Exception:
                        log.warning("could not remove %s of run %s", made.id, spec.run_id)
            raise
        handle = DockerHandle(container, holder, network, dict(self.enforcement))

        def pump() -> None:
            try:
                for out, err in stream:
                    if out:
                        on_stdout(out)
                    if err:
                        on_stderr(err)
            except Exception:  # noqa: S110 - a killed container may cut the stream
                pass

        handle.reader = threading.Thread(target=pump, name=f"out-{spec.run_id}", daemon=True)
        handle.reader.start()
        return handle  # created and attached; release() starts it


class GvisorBackend(DockerBackend):
    """The Docker backend under gVisor's runsc (a user-space kernel between the code
    and the host's). The engine must register it, with runsc's own network off:
    /etc/docker/daemon.json {"runtimes": {"runsc": {"path": "/usr/bin/runsc",
    "runtimeArgs": ["--network=none"]}}}. No egress under it (refused)."""

    name = "gvisor"
    runtime = "runsc"
    # The engine's pids limit counts the host threads of gVisor's kernel, not the guest's
    # processes: a guest fork bomb does not get EAGAIN, the whole sandbox dies at the cap.
    enforcement = {**DockerBackend.enforcement, "pids": "docker (gVisor kernel threads)"}


def wait_gone(client: Any, run_id: str, timeout: float = 10.0) -> bool:
    """True once no container labelled with run_id exists (tests and reaper)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not client.containers.list(all=True, filters={"label": f"{LABEL_RUN}={run_id}"}):
            return True
        time.sleep(0.1)
    return False
