"""The runner's contract: what to run (RunSpec), what governance allowed
(Authorization), and what happened (RunResult). No Django here.

Limits and egress follow one rule, `effective()`: the grant's values are the
ceiling. A request above a ceiling is refused (never silently lowered), a
request below it is honoured, and what is left unsaid takes the ceiling. A
grant without a value for a limit gets the runner's floor (DEFAULT_LIMITS),
never "unlimited".
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sandbox_runner.egress import Destination, parse_destination

DEFAULT_TOOL = "code-exec"
DEFAULT_IMAGE = "governance-sandbox:bookworm"
# Backends with no image: what runs is the host's /usr, read-only. Their runs are the
# image `host` (scope `sandbox:host`), whatever image was named, so a grant scoped to
# one image (`sandbox:locked-down:v1`) is not stretched to the host's every binary by
# asking for the weakest backend under that image's name.
HOST_BACKENDS = frozenset({"bubblewrap"})
HOST_IMAGE = "host"


def host_image_problem(backend: str, image: str) -> str | None:
    """Why `image` cannot be asked of `backend`, or None. The default image stands for
    "whatever this backend runs" and becomes `host`."""
    if backend in HOST_BACKENDS and image not in (HOST_IMAGE, DEFAULT_IMAGE):
        return (
            f"{backend} runs the host's /usr, not an image: ask for image {HOST_IMAGE!r} "
            f"(a grant on sandbox:{HOST_IMAGE}), not {image!r:.80}"
        )
    return None


# Where the script and input appear inside the sandbox (read-only).
SCRIPT_PATH = "/sandbox/script"
INPUT_PATH = "/sandbox/input"
OUTPUT_CAP = 1024 * 1024  # bytes kept per stream; the hash covers all of it
# The run record keeps a masked excerpt of each stream. Masking is regex work
# that grows faster than linearly on long unbroken runs, so it stays small.
EXCERPT_CHARS = 4096
# The script and input are hashed into the decision; up to this size their bytes also
# go with the request, so a person asked to approve the run reads what would run.
REVIEW_MAX_BYTES = 64 * 1024


# An engine's image id: the SHA-256 of the image's configuration, which names its layers.
IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")


def image_scope(image: str) -> str:
    """The resource a run of `image` is: what an `execute` grant's scope must cover."""
    return "sandbox:" + re.sub(r"[^A-Za-z0-9._~:@/-]", "_", image)


@dataclass(frozen=True)
class Limits:
    """Resource limits for one run. Every field is a hard ceiling inside the sandbox."""

    memory_mb: int
    cpus: float
    pids: int
    wall_seconds: int
    # The size of /workspace, the one writable directory (a tmpfs: its pages also
    # count against memory_mb); a write past it fails with ENOSPC.
    scratch_mb: int

    @classmethod
    def from_values(cls, values: Mapping[str, float | int]) -> Limits:
        """From a mapping with one number per LIMIT_NAMES entry (checked by the caller)."""
        return cls(
            memory_mb=int(values["memory_mb"]),
            cpus=float(values["cpus"]),
            pids=int(values["pids"]),
            wall_seconds=int(values["wall_seconds"]),
            scratch_mb=int(values["scratch_mb"]),
        )


# The runner's floor: what a grant without explicit limits gets.
DEFAULT_LIMITS = Limits(memory_mb=256, cpus=1.0, pids=64, wall_seconds=60, scratch_mb=64)
LIMIT_NAMES = ("memory_mb", "cpus", "pids", "wall_seconds", "scratch_mb")
# The smallest value each limit can be enforced at (Docker: 0.01 CPUs, 6 MiB).
LIMIT_MIN = {"memory_mb": 6, "cpus": 0.01, "pids": 1, "wall_seconds": 1, "scratch_mb": 1}
# The largest any grant may hold (governance.codes.LIMIT_BOUNDS is made of these two), so
# the CLI refuses a request above it as a usage error instead of asking governance.
LIMIT_MAX = {
    "memory_mb": 1 << 20,
    "cpus": 1024,
    "pids": 1 << 22,
    "wall_seconds": 7 * 86400,
    "scratch_mb": 1 << 20,
}


@dataclass(frozen=True)
class RunSpec:
    """One execution as the caller asked for it (before governance answers).

    `limits` holds only what the caller asked for (None = take the ceiling);
    `egress` is None when the caller did not narrow the grant's list.
    """

    agent: str
    task: str | None
    command: tuple[str, ...]
    tool: str = DEFAULT_TOOL
    backend: str = "docker"
    image: str = DEFAULT_IMAGE
    # What `image` named when the decision was asked for (Docker: the image id,
    # `sha256:...`), resolved by the runner before it asks: the decision (and so an
    # approval) binds these bytes, and the backend starts exactly them, even if the name
    # is moved to other bytes meanwhile. Empty where a backend has no image to bind
    # (bubblewrap runs the host's /usr) or the name did not resolve (image_problem).
    image_id: str = ""
    # Why the runner could not resolve `image` (missing, declares a VOLUME, the engine
    # failed): governance refuses the run with it on record (image_unresolved). Not
    # hashed: it is not what would run.
    image_problem: str = ""
    script: bytes | None = None
    input: bytes | None = None
    limits: Mapping[str, float | int | None] = field(default_factory=dict)
    egress: tuple[str, ...] | None = None
    run_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    # A server that never sees the bytes (the REST API) gets their hashes instead.
    script_hash: str = ""
    input_hash: str = ""
    # The confirmation gate: an approved approval for this exact run (same tool, image,
    # command, script and input hashes, limits and egress), used once. A code-execution
    # tool marked irreversible answers approval_required until one is named.
    approval: str | None = None

    def __post_init__(self) -> None:
        # The run id names the run's cgroups, work directory and containers on the host,
        # and a refused run removes (killing what is inside) the cgroups it names: only
        # a UUID's canonical text can never name a path elsewhere ("../victim").
        if not is_run_id(self.run_id):
            raise ValueError(f"run_id must be a UUID in canonical form, not {self.run_id!r:.80}")
        if self.image_id and not IMAGE_ID.fullmatch(self.image_id):
            raise ValueError(
                f"image_id must be sha256: and 64 hex digits, not {self.image_id!r:.80}"
            )
        if problem := host_image_problem(self.backend, self.image):
            raise ValueError(problem)
        if problem := self._text_problem():
            raise ValueError(problem)
        if self.backend in HOST_BACKENDS:
            object.__setattr__(self, "image", HOST_IMAGE)  # frozen: set once, here

    def _text_problem(self) -> str | None:
        """What the run would ask and record that cannot be stored as text: a NUL, or
        a byte that is not UTF-8 (a file name's, which Python reads as a lone
        surrogate). Such a run could be neither asked for nor put on record."""
        named = [("agent", self.agent), ("task", self.task), ("tool", self.tool)]
        named += [("image", self.image), ("approval", self.approval)]
        named += [("a command word", word) for word in self.command]
        named += [("an egress entry", entry) for entry in self.egress or ()]
        for what, value in named:
            if value is None:
                continue
            shown = value.encode("utf-8", "backslashreplace").decode()
            if "\x00" in value or shown != value:  # a lone surrogate shows as \udcff
                return f"{what} must be UTF-8 text without NUL bytes, not {shown!r:.80}"
        return None

    @property
    def script_sha256(self) -> str:
        if self.script is None:
            return self.script_hash
        return hashlib.sha256(self.script).hexdigest()

    @property
    def input_sha256(self) -> str:
        if self.input is None:
            return self.input_hash
        return hashlib.sha256(self.input).hexdigest()

    @property
    def scope(self) -> str:
        """The resource an `execute` grant must cover: the image, e.g. `sandbox:*`."""
        return image_scope(self.image)

    def arguments(self) -> dict[str, Any]:
        """What governance sees (and hashes) for the decision: what would run (the
        image's bytes by id, not only its name), not which run it is. An approval binds
        to the arguments' hash, so a run id in it (new for every try) would make an
        approved run impossible to ask for again."""
        return {
            "backend": self.backend,
            "image": self.image,
            "image_id": self.image_id,
            "command": list(self.command),
            "script_sha256": self.script_sha256,
            "input_sha256": self.input_sha256,
            "limits": {name: self.limits.get(name) for name in LIMIT_NAMES},
            "egress": list(self.egress) if self.egress is not None else None,
        }


def is_run_id(value: object) -> bool:
    """A UUID as str(uuid.UUID(...)) writes it: lower-case hex with four hyphens."""
    try:
        return isinstance(value, str) and str(uuid.UUID(value)) == value
    except ValueError:
        return False


class OverCeiling(ValueError):
    """A request above what the grant allows; the message says which part."""


def effective(
    spec: RunSpec,
    ceiling: Mapping[str, float | int | None],
    granted_egress: Sequence[str],
) -> tuple[Limits, tuple[Destination, ...]]:
    """The limits and egress a run gets under a grant, or OverCeiling.

    `ceiling` is the grant's limits (None = the runner's floor). Egress: the
    grant's list unless the caller named a subset; naming anything the grant
    does not list is refused.
    """
    values: dict[str, Any] = {}
    for name in LIMIT_NAMES:
        cap = ceiling.get(name)
        cap = getattr(DEFAULT_LIMITS, name) if cap is None else cap
        asked = spec.limits.get(name)
        if asked is None:
            value = cap
        elif isinstance(asked, bool) or not isinstance(asked, int | float) or asked != asked:
            # NaN compares false with everything: it passed both the ceiling and the floor.
            raise OverCeiling(f"{name} {asked!r} is not a number")
        elif asked > cap:
            raise OverCeiling(f"{name} {asked} is above the grant's {cap}")
        else:
            value = asked
        # Below its smallest enforceable value a limit would become "no limit" on the
        # way down (Docker reads 0 nano-CPUs, 0 pids or 0 bytes as unlimited).
        whole = name != "cpus"
        # (-inf passes the ceiling and would overflow int(): not a whole number either.)
        if (
            isinstance(value, bool)
            or (whole and (not math.isfinite(value) or value != int(value)))
            or value < LIMIT_MIN[name]
        ):
            kind = "a whole number" if whole else "a number"
            raise OverCeiling(f"{name} must be {kind} of at least {LIMIT_MIN[name]} (got {value})")
        values[name] = value
    limits = Limits.from_values(values)
    granted = tuple(parse_destination(e) for e in granted_egress)
    if spec.egress is None:
        return limits, granted
    wanted = tuple(parse_destination(e) for e in spec.egress)
    extra = [str(d) for d in wanted if d not in granted]
    if extra:
        raise OverCeiling(f"egress to {', '.join(extra)} is not in the grant")
    return limits, wanted


@dataclass(frozen=True)
class Authorization:
    """Governance's answer for one run. Only `allowed` starts anything.

    `outcome` is allow | deny | approval_required | unreachable | malformed.
    """

    outcome: str
    reason: str
    message: str
    run_id: str
    limits: Limits | None = None
    egress: tuple[Destination, ...] = ()
    grant_id: int | None = None
    approval_id: str | None = None
    decision_id: str | None = None

    @property
    def allowed(self) -> bool:
        return self.outcome == "allow" and self.limits is not None


@dataclass
class Captured:
    """One output stream: the first OUTPUT_CAP bytes and the hash of all of it."""

    cap: int = OUTPUT_CAP
    head: bytearray = field(default_factory=bytearray)
    total: int = 0
    _hash: Any = field(default_factory=hashlib.sha256)

    def feed(self, chunk: bytes) -> None:
        self._hash.update(chunk)
        self.total += len(chunk)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head)


@dataclass
class RunResult:
    """What happened. exit_code None means the code never ran to an exit."""

    run_id: str
    backend: str
    exit_code: int | None = None
    timed_out: bool = False
    oom_killed: bool = False
    stdout: Captured = field(default_factory=Captured)
    stderr: Captured = field(default_factory=Captured)
    image_digest: str = ""
    container_id: str = ""
    # How the limits were enforced: docker (cgroups via the engine), cgroup, rlimit.
    enforcement: dict[str, str] = field(default_factory=dict)
    error: str = ""

    def summary(self) -> dict[str, Any]:
        """The JSON-safe record of the result (for the run record and audit event)."""
        out: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("stdout", "stderr")
        }
        for name in ("stdout", "stderr"):
            stream: Captured = getattr(self, name)
            out[name] = {
                # The record keeps a short excerpt (masking is regex work: it is cut
                # first), and NUL is not storable text (PostgreSQL refuses it, and the
                # whole outcome with it: a run could keep its own end off the record).
                "excerpt": bytes(stream.head[: 4 * EXCERPT_CHARS])
                .decode("utf-8", "replace")[:EXCERPT_CHARS]
                .replace("\x00", "\ufffd"),
                "sha256": stream.sha256,
                "bytes": stream.total,
                "truncated": stream.truncated,
            }
        return out


class FileTooLarge(ValueError):
    """A script or input file above the runner's bound."""


def read_file(path: str | Path, limit: int) -> bytes:
    """The file's bytes, reading at most one byte past `limit` (a device or a growing
    file never makes the runner read on without end)."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise FileTooLarge(path)
    return data
