"""The runner: authorize, then run in a throwaway sandbox, then record.

Nothing starts unless governance says allow. The runner owns the wall clock
(kill at the deadline, whatever the backend), the egress proxy, the output
capture and every call to the authorizer. All authorizer calls happen on this
(the calling) thread: the run's helper thread (_Watch), output readers and
proxy threads only hand their data over, so the in-process adapter uses one
database connection in order.

Order of a run: prepare (host-side, no decision needed) alongside authorize;
start (a backend that can hold the sandbox blocked does); record the start;
release; wait for the exit or the deadline; record the outcome while the
sandbox is torn down. The start is on record before the code runs (bubblewrap
holds the sandbox blocked, Docker has only created the container), and every
egress attempt is on record before the proxy acts on it.

Exit status: the code's own status when it ran to an exit; otherwise one of
the EXIT_* codes below (documented in the README). A run the runner stopped
because it may not go on (its grant can no longer allow it: the kill switch; or
a flood of egress attempts) is EXIT_DENIED, not the status of the SIGKILL that
stopped it (137, which reads as the code's own out-of-memory death).
"""

from __future__ import annotations

import os
import queue
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from sandbox_runner.authorizers import Authorizer
from sandbox_runner.backends import (
    IMAGE_UNRESOLVED,
    Backend,
    BackendUnavailable,
    Handle,
    get_backend,
)
from sandbox_runner.egress import EgressDecision
from sandbox_runner.proxy import EgressProxy
from sandbox_runner.spec import IMAGE_ID, Authorization, RunResult, RunSpec

# Distinct statuses for "the code never ran" (sysexits.h where one fits).
EXIT_UNREACHABLE = 69  # EX_UNAVAILABLE: no decision (no answer, a 5xx, a 429): retry later
EXIT_ERROR = 70  # EX_SOFTWARE: the runner itself failed (nothing was left running)
EXIT_BACKEND = 71  # EX_OSERR: the backend is unavailable or could not start the sandbox
EXIT_APPROVAL = 75  # EX_TEMPFAIL: approval required; retry once a human approved
EXIT_MALFORMED = 76  # EX_PROTOCOL: governance answered something that is not a decision
# EX_NOPERM: denied (no grant, expired, suspended, over the grant's limits); also a run
# the runner stopped while it ran because it may not go on (see execute()).
EXIT_DENIED = 77
EXIT_TIMEOUT = 124  # killed at the wall-clock timeout (as timeout(1) does)

EXIT_FOR_OUTCOME = {
    "deny": EXIT_DENIED,
    "approval_required": EXIT_APPROVAL,
    "unreachable": EXIT_UNREACHABLE,
    "malformed": EXIT_MALFORMED,
}
POLL = 0.05  # seconds between deadline checks and egress-record flushes
EGRESS_BATCH = 32  # egress attempts recorded per turn of the runner's loop
MAX_EGRESS_ATTEMPTS = 1000  # per run; past it the run is stopped (a flood, not work)
LIVE_CHECK = 2.0  # seconds between "can its grant still allow it?" while it runs


@dataclass
class Outcome:
    exit_code: int
    auth: Authorization | None
    result: RunResult | None


def _say(message: str) -> None:
    print(f"sandbox_runner: {message}", file=sys.stderr, flush=True)


def workdir_root() -> Path:
    return Path(os.environ.get("SANDBOX_WORKDIR") or tempfile.gettempdir()) / "governance-sandbox"


def prepare_workdir(spec: RunSpec, owner: int | None = None) -> Path:
    """A fresh directory per run: in/ (read-only copies of the script and input).

    Only the runner (and the engine, root) may enter it, or `owner` (the uid that a
    backend's own process runs as, Backend.workdir_owner()): the run's input and script,
    and bwrap's /tmp mounted under it, are no other host account's to read or write.
    Its path is no secret (a process's command line and mounts show it).

    The script and input are copied, so what runs is exactly what was hashed. The
    run's writable /workspace is not here: each backend makes it a tmpfs of the
    run's scratch_mb, so a run cannot fill the host's disk.
    """
    root = workdir_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o711)
    _check_root(root)
    workdir = Path(tempfile.mkdtemp(prefix=f"run-{spec.run_id}-", dir=root))
    try:
        os.chmod(workdir, 0o700)
        if owner is not None:
            os.chown(workdir, owner, owner)
        inputs = workdir / "in"
        inputs.mkdir(mode=0o755)
        for name, data in (("script", spec.script), ("input", spec.input)):
            if data is not None:
                path = inputs / name
                path.write_bytes(data)
                path.chmod(0o444)
    except BaseException:
        # Nothing else knows of it (no container names it): a full disk must not leave
        # a partial copy behind for every failed run.
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return workdir


class UnsafeWorkdir(RuntimeError):
    """The work directory root could be changed by someone else: nothing is run."""


def _check_root(root: Path) -> None:
    """The root that holds every run's directory must be a real directory of ours that
    nobody else may write: it lives under a shared /tmp by default, and whoever can
    rename entries in it could swap a run's directory for a symlink before the
    runner (often root) writes the script or mounts it."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeWorkdir(f"{root} is not a directory (a symlink?): refusing to run")
    if st.st_uid != os.geteuid():
        raise UnsafeWorkdir(f"{root} belongs to uid {st.st_uid}, not to the runner: refusing")
    if st.st_mode & 0o022:
        raise UnsafeWorkdir(f"{root} is writable by others: refusing (chmod go-w it)")


def _tee(sink: BinaryIO | None, captured: Callable[[bytes], None]) -> Callable[[bytes], None]:
    def feed(chunk: bytes) -> None:
        captured(chunk)
        if sink is not None:
            try:
                sink.write(chunk)
                sink.flush()
            except (OSError, ValueError):
                pass  # the caller went away; capture goes on

    return feed


def execute(
    spec: RunSpec,
    authorizer: Authorizer,
    *,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    on_started: Callable[[RunSpec, object], None] | None = None,
) -> Outcome:
    """Authorize and run one spec. Never raises for the sandboxed code's sake."""
    try:
        backend = get_backend(spec.backend)
    except BackendUnavailable as exc:
        _say(str(exc))
        return Outcome(EXIT_BACKEND, None, None)
    # The image is resolved here, by the runner, never taken from the caller: the
    # decision binds the bytes the name points to now (an approval is for them, not for
    # whatever the name is moved to later), and start() runs exactly those. A name that
    # does not resolve binds nothing: the question is still asked, with the reason, and
    # governance refuses it on record (image_unresolved).
    image_id, problem = "", ""
    try:
        image_id = backend.image_id(spec.image)
        if image_id and not IMAGE_ID.fullmatch(image_id):
            problem, image_id = f"the engine named it {image_id[:80]!r}, not an image id", ""
    except Exception as exc:  # missing, refused (VOLUME), or the engine failed
        problem = str(exc) or type(exc).__name__
    spec = replace(spec, image_id=image_id, image_problem=problem[:500])
    # The run's one helper thread, started first: it does the backend's host-side
    # set-up that needs no decision (bubblewrap: empty cgroups and the cgroup move's
    # grace period) while the authorizer's round trips run here; later it follows
    # the sandbox. prepare() starts nothing; a refused run's is undone before
    # execute() returns.
    watch = _Watch(backend.prepare(spec), spec.run_id)
    try:
        auth = authorizer.authorize(spec)
    except BaseException:  # authorize() never raises; still, leave nothing behind
        watch.cancel()
        backend.discard()
        raise
    if not auth.allowed:
        watch.cancel()
        backend.discard()
        _say(f"not started: {auth.outcome} ({auth.reason}): {auth.message}")
        if auth.outcome == "approval_required" and auth.approval_id:
            _say(
                f"approval {auth.approval_id} awaits a person; once approved, run the same "
                f"again with --approval {auth.approval_id}"
            )
        if problem:
            _say(problem)  # why the image did not resolve: this host's to fix
            if auth.reason == IMAGE_UNRESOLVED:
                return Outcome(EXIT_BACKEND, auth, None)
        return Outcome(EXIT_FOR_OUTCOME.get(auth.outcome, EXIT_DENIED), auth, None)
    assert auth.limits is not None

    result = RunResult(run_id=spec.run_id, backend=spec.backend)
    egress = _EgressLog(wake=watch.wake)
    proxy = (
        EgressProxy(auth.egress, report=egress.record, note=egress.note) if auth.egress else None
    )
    try:
        workdir = prepare_workdir(spec, backend.workdir_owner())
    except Exception as exc:  # nothing was started: record why, as a failed start
        watch.cancel()
        backend.discard()
        result.error = f"the run's files could not be prepared: {exc}"
        _say(result.error)
        try:
            authorizer.finished(spec, auth, result)
        except Exception as record_exc:
            _say(f"the run's outcome could not be recorded: {record_exc}")
            return Outcome(EXIT_ERROR, auth, result)
        return Outcome(EXIT_BACKEND, auth, result)
    except BaseException:
        watch.cancel()
        backend.discard()
        raise
    deadline = time.time() + auth.limits.wall_seconds
    handle: Handle | None = None
    # Set when the runner stopped the run because it may not go on (stop() below): the
    # run then ends EXIT_DENIED, its record's error saying why.
    stopped: str | None = None
    try:
        handle = backend.start(
            spec,
            auth,
            workdir,
            deadline,
            _tee(stdout, result.stdout.feed),
            _tee(stderr, result.stderr.feed),
            proxy.bind_in if proxy else None,
        )
        watch.follow(backend, handle, workdir)
        result.container_id = handle.container_id
        result.image_digest = handle.image_digest
        result.enforcement = dict(handle.enforcement)
        # Recorded before the code runs: the backend holds it until release()
        # (bubblewrap: the record overlaps bwrap building its namespaces); a start that
        # cannot be recorded is killed before it ran (the except below, then teardown).
        authorizer.started(spec, auth, result, deadline)
        handle.release()
        if on_started is not None:
            on_started(spec, handle)
        next_check = time.monotonic() + LIVE_CHECK

        def stop(why: str) -> None:
            nonlocal stopped
            stopped = result.error = why
            _say(why)
            handle.kill()

        while not watch.exited.is_set():
            watch.wake.clear()  # set again by the exit or by an egress attempt
            # A bounded batch per turn: a flood of attempts cannot keep the deadline
            # check below from running.
            egress.flush(authorizer, spec, limit=EGRESS_BATCH)
            if egress.flooded and not result.error:
                stop(f"over {MAX_EGRESS_ATTEMPTS} egress attempts: stopped")
            if time.monotonic() >= next_check and not result.error:
                # The kill switch reaches a running sandbox within LIVE_CHECK seconds.
                next_check = time.monotonic() + LIVE_CHECK
                dead = authorizer.dead_reason(spec)
                if dead is not None:
                    stop(f"stopped: its grant can no longer allow it ({dead})")
            remaining = deadline - time.time()
            if remaining <= 0:
                result.timed_out = True
            if result.timed_out or stopped:
                # SIGKILL at the deadline (not a polite stop) or on a stop, and again
                # every turn until the exit: a kill the backend failed (a busy engine's
                # error or timeout) must not let the code run on.
                handle.kill()
            watch.wake.wait(min(POLL, max(remaining, 0.0)) if remaining > 0 else POLL)
        result.exit_code = watch.code
        if result.exit_code is None and not stopped:
            result.error = "the sandbox vanished before reporting an exit (reaped?)"
        result.oom_killed = watch.oom_killed()
    except BackendUnavailable as exc:
        _say(str(exc))
        result.error = "; ".join(filter(None, (stopped, str(exc))))
    except Exception as exc:
        _say(f"the run failed: {type(exc).__name__}: {exc}")
        # A stop's reason stays on record beside what failed after it.
        result.error = "; ".join(filter(None, (stopped, f"{type(exc).__name__}: {exc}")))
    finally:
        # Removal (tens of ms on the engine) overlaps with recording the outcome;
        # execute() returns only once both are done.
        if handle is None:  # start() failed: the watch only undoes prepare()
            watch.follow(backend, None, workdir)
        elif not watch.exited.is_set():
            handle.kill()  # an error before the exit: the watch then tears it down
        if proxy is not None:
            # Connections still waiting to be served are put on record as refused; then
            # the proxy stops, and its handlers finish while their attempts are written
            # (one still deciding when the sandbox exited too); only then is the log
            # closed. A failed record fails the run below.
            proxy.drain()
            proxy.stop(pump=lambda: egress.flush(authorizer, spec))
    egress_lost = False
    try:
        egress.close(authorizer, spec)
    except Exception as exc:  # the run's record still ends, and says so
        egress_lost = True
        result.error = "; ".join(filter(None, (result.error, str(exc))))
        _say(str(exc))
    recorded = True
    try:
        authorizer.finished(spec, auth, result)
    except Exception as exc:
        _say(f"the run's outcome could not be recorded: {type(exc).__name__}: {exc}")
        recorded = False
    finally:
        watch.thread.join()
    if egress_lost:
        return Outcome(EXIT_ERROR, auth, result)
    if stopped:
        # Denied while it ran: whatever its SIGKILL left as a status (137, or none if
        # it vanished, or a timeout that landed while it died), the answer is "no". Also
        # when its end could not be recorded: a suspended agent's token, which a remote
        # runner reports with, is refused for that too (the reaper closes the record).
        _say(f"denied while it ran: {stopped}")
        return Outcome(EXIT_DENIED, auth, result)
    if not recorded:
        return Outcome(EXIT_ERROR, auth, result)
    if result.error and result.exit_code is None:
        return Outcome(EXIT_BACKEND, auth, result)
    if result.timed_out:
        _say(f"killed at the {auth.limits.wall_seconds}s timeout")
        return Outcome(EXIT_TIMEOUT, auth, result)
    if result.oom_killed:
        _say(f"killed: out of memory (limit {auth.limits.memory_mb} MiB)")
    return Outcome(result.exit_code if result.exit_code is not None else EXIT_ERROR, auth, result)


class _Watch:
    """The run's one helper thread, started before anything else (one thread
    start per run, while nothing else competes for a CPU yet): first the
    backend's prepare() work, then, once the runner hands it a sandbox, it waits
    for the exit, reads whether it was OOM-killed, tells the runner, and tears
    the sandbox down (overlapping the runner's record of the outcome). A refused
    run cancels it; a failed start hands it None (tear down what is left)."""

    def __init__(self, prepare: Callable[[], None] | None, run_id: str) -> None:
        self.exited = threading.Event()
        # Wakes the runner's loop: set with `exited`, and by every egress attempt.
        self.wake = threading.Event()
        self.code: int | None = None
        self._oom: bool | BaseException = False
        self._prepare = prepare
        self._go = threading.Event()
        self._job: tuple[Backend, Handle | None, Path] | None = None
        self.thread = threading.Thread(target=self._run, name=f"watch-{run_id}", daemon=True)
        self.thread.start()

    def follow(self, backend: Backend, handle: Handle | None, workdir: Path) -> None:
        self._job = (backend, handle, workdir)
        self._go.set()

    def cancel(self) -> None:
        self._go.set()

    def _run(self) -> None:
        if self._prepare is not None:
            try:
                self._prepare()
            except Exception as exc:  # start() then does without it
                _say(f"host-side set-up failed: {type(exc).__name__}: {exc}")
        self._go.wait()
        if self._job is None:
            return
        backend, handle, workdir = self._job
        try:
            if handle is not None:
                try:
                    self.code = handle.wait()
                finally:
                    try:
                        self._oom = handle.oom_killed()
                    except Exception as exc:
                        self._oom = exc
        finally:
            self.exited.set()
            self.wake.set()
            _teardown(backend, handle, workdir)

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended it (raises what the backend raised)."""
        if isinstance(self._oom, BaseException):
            raise self._oom
        return self._oom


def _teardown(backend: Backend, handle: Handle | None, workdir: Path) -> None:
    if handle is not None:
        handle.cleanup()  # kills first
    else:  # start() failed before there was a sandbox: undo prepare()
        backend.discard()
    shutil.rmtree(workdir, ignore_errors=True)


class EgressNotRecorded(RuntimeError):
    """The attempt could not be put on record, so the proxy refuses it."""


class _EgressLog:
    """Egress attempts, put on record by the runner's thread (which owns every
    authorizer call) while the proxy's handler thread waits: an allowed attempt
    connects only once its event is written. A write that fails fails that attempt,
    every attempt still waiting and every later one, and the run."""

    WAIT = 10.0  # seconds a handler waits for its record before refusing

    def __init__(self, wake: threading.Event) -> None:
        self._wake = wake
        self._pending: queue.SimpleQueue[_Attempt] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None
        self._count = 0
        self.flooded = False  # more than MAX_EGRESS_ATTEMPTS: the runner stops the run

    def record(self, decision: EgressDecision) -> None:
        """Proxy side: returns once on record; raises EgressNotRecorded otherwise."""
        attempt = self._enqueue(decision)
        if not attempt.done.wait(self.WAIT):
            with self._lock:
                if not attempt.taken:  # the runner has not begun to write it: give it up,
                    attempt.abandoned = True  # and it is written as refused (flush)
                    raise EgressNotRecorded(f"not recorded within {self.WAIT:g} s")
            # Being written now: what that write says decides (bounded by its own timeouts).
            attempt.done.wait(self.WAIT)
        if not attempt.done.is_set():
            raise EgressNotRecorded(f"not recorded within {2 * self.WAIT:g} s")
        if attempt.error is not None:
            raise EgressNotRecorded(str(attempt.error))

    def note(self, decision: EgressDecision) -> None:
        """Proxy side, for a refusal: on the way to the record, without waiting (the
        proxy refuses whatever the write does; a write that fails fails the run)."""
        self._enqueue(decision)

    def _enqueue(self, decision: EgressDecision) -> _Attempt:
        attempt = _Attempt(decision)
        with self._lock:
            if self._closed:
                raise EgressNotRecorded("the run is over")
            if self._count >= MAX_EGRESS_ATTEMPTS:
                self.flooded = True
                self._wake.set()
                raise EgressNotRecorded(f"over {MAX_EGRESS_ATTEMPTS} attempts in this run")
            self._count += 1
            self._pending.put(attempt)
        self._wake.set()
        return attempt

    def flush(self, authorizer: Authorizer, spec: RunSpec, limit: int | None = None) -> None:
        """Runner side: record the waiting attempts, in order (at most `limit`; the
        loop is woken again if more are waiting)."""
        done = 0
        while True:
            if limit is not None and done >= limit:
                self._wake.set()
                return
            try:
                attempt = self._pending.get_nowait()
            except queue.Empty:
                return
            done += 1
            with self._lock:
                attempt.taken = True
                decision = attempt.decision
                if attempt.abandoned and decision.allowed:
                    # Its handler gave up waiting and refused it: it connected nowhere.
                    decision = replace(decision, allowed=False, reason="not_recorded_in_time")
            try:
                authorizer.egress(spec, decision)
            except BaseException as exc:
                self._fail(attempt, exc)
                raise
            attempt.done.set()

    def close(self, authorizer: Authorizer, spec: RunSpec) -> None:
        """Runner side: no new attempts; record those already made. Raises if any
        attempt of this run could not be recorded (then, every time it is called)."""
        with self._lock:
            self._closed = True
        if self._error is None:
            self.flush(authorizer, spec)
        if self._error is not None:
            raise EgressNotRecorded(f"an egress attempt was not recorded: {self._error}")

    def _fail(self, attempt: _Attempt, error: BaseException) -> None:
        with self._lock:
            self._closed = True
            self._error = error
        attempt.fail(error)
        while True:
            try:
                self._pending.get_nowait().fail(error)
            except queue.Empty:
                return


@dataclass
class _Attempt:
    decision: EgressDecision
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    taken: bool = False  # the runner began writing it (under _EgressLog._lock)
    abandoned: bool = False  # its handler stopped waiting first, and refused it

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()
