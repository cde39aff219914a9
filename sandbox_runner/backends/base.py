"""The tiny backend interface. A backend turns an authorized RunSpec into one
throwaway sandbox; the runner (sandbox_runner.runner) owns the clock, the
records and the egress proxy, so every backend is killed and recorded alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sandbox_runner.spec import Authorization, RunSpec

Sink = Callable[[bytes], None]
# Called with the pid of a process already inside the sandbox's network
# namespace, before the sandboxed code runs: the runner binds its egress proxy
# there. None when the run has no egress (the namespace stays empty).
NetworkHook = Callable[[int], None] | None

# Labels (Docker) / record fields shared by the reaper.
LABEL_RUN = "governance.sandbox.run"
LABEL_DEADLINE = "governance.sandbox.deadline"
LABEL_AGENT = "governance.sandbox.agent"
LABEL_WORKDIR = "governance.sandbox.workdir"
LABEL_ROLE = "governance.sandbox.role"


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this host (no engine, no bwrap, no image)."""


class Handle:
    """One started sandbox."""

    container_id: str = ""
    image_digest: str = ""
    enforcement: dict[str, str]

    def wait(self) -> int | None:
        """Block until the sandbox exits; its exit status (None if it vanished,
        e.g. removed by the reaper). Runs in a thread."""
        raise NotImplementedError("Handle.wait() must be implemented by the backend")

    def kill(self) -> None:
        """Kill at once (SIGKILL, not a polite stop). Safe to call twice."""
        raise NotImplementedError("Handle.kill() must be implemented by the backend")

    def oom_killed(self) -> bool:
        raise NotImplementedError("Handle.oom_killed() must be implemented by the backend")

    def cleanup(self) -> None:
        """Kill the sandbox if it still runs, then remove it and everything it left
        behind."""
        raise NotImplementedError("Handle.cleanup() must be implemented by the backend")

    def release(self) -> None:
        """Let the code run. start() returns before the code runs (bubblewrap holds
        the sandbox blocked, Docker has created but not started the container), so
        that the runner records the start first; release() then lets it go (and
        bubblewrap puts it in its limits). A backend whose start() already runs the
        code does nothing here. Raises if the sandbox cannot be released (the runner
        then kills it)."""
        return None


class Backend:
    name = "base"

    def unavailable(self) -> str | None:
        """None when usable here, else a sentence saying why not."""
        raise NotImplementedError(f"{type(self).__name__}.unavailable() is not implemented")

    def workdir_owner(self) -> int | None:
        """The host uid of the process that opens the run's directory itself, when it is
        not the runner's (bwrap, as uid 1000 under a root runner); None when only the
        runner and the engine (root) do. Nobody else may enter the directory."""
        return None

    def image_id(self, image: str) -> str:
        """What `image` names on this host now, as the runner binds it into the decision
        (RunSpec.image_id), or "" when the backend has no image to bind. Raises
        BackendUnavailable when the name does not resolve (or names an image this
        backend refuses). Every backend says, so none binds nothing by omission."""
        raise NotImplementedError(f"{type(self).__name__}.image_id() is not implemented")

    def prepare(self, spec: RunSpec) -> Callable[[], None] | None:
        """Optional host-side set-up that makes start() faster, done while governance
        decides: returns the work, which the runner runs in a thread of its own (it
        may block); start() waits for what it needs of it. It must start nothing,
        run nothing, and put nothing within reach of any code: a refused run is as
        if prepare() never happened once discard() has returned."""
        return None

    def discard(self) -> None:
        """Undo prepare() for a run that will not start (refused, or start() failed
        before it returned a handle). Safe to call when prepare() did nothing."""
        return None

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
        """Create and start the sandbox; output goes to the sinks as it comes."""
        raise NotImplementedError(f"{type(self).__name__}.start() is not implemented")
