"""The reaper: kill and remove sandboxes that must not live on.

A container carries its run id and deadline as labels, so the reaper needs
no state of its own. It kills (SIGKILL) and removes every container of a run
that `why` says must die: past its deadline (e.g. the runner itself was
SIGKILLed and can no longer enforce the timeout), or because governance says
the run's grant can no longer allow anything (agent suspended, grant revoked).
`record` marks the run. No Django here: the callers pass both functions in.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandbox_runner.backends.base import LABEL_DEADLINE, LABEL_RUN, LABEL_WORKDIR

Why = Callable[[str, float], str | None]
Record = Callable[[str, str], None]


def reap(
    client: Any, why: Why, record: Record, workdir_root: Path | None = None
) -> list[tuple[str, str]]:
    """One pass. Returns (run_id, reason) for every run it killed."""
    runs: dict[str, list[Any]] = {}
    for container in client.containers.list(all=True, filters={"label": LABEL_RUN}):
        runs.setdefault(container.labels.get(LABEL_RUN, ""), []).append(container)
    killed: list[tuple[str, str]] = []
    for run_id, containers in runs.items():
        deadlines = []
        for container in containers:
            try:
                deadlines.append(float(container.labels.get(LABEL_DEADLINE, "0")))
            except ValueError:
                deadlines.append(0.0)  # a label we cannot read is a container we do not keep
        reason = why(run_id, min(deadlines))
        if reason is None:
            continue
        for container in containers:
            try:
                container.kill()
            except Exception:  # noqa: S110 - already stopped; removal below still applies
                pass
            try:
                container.remove(force=True, v=True)
            except Exception:  # noqa: S110 - gone already (the runner cleaned up meanwhile)
                pass
            if workdir_root is not None:
                workdir = _own_workdir(
                    container.labels.get(LABEL_WORKDIR, ""), run_id, workdir_root
                )
                if workdir is not None:
                    shutil.rmtree(workdir, ignore_errors=True)
        record(run_id, reason)
        killed.append((run_id, reason))
    return killed


def past_deadline(run_id: str, deadline: float) -> str | None:
    """The reaper's rule without governance: only the deadline counts."""
    return "deadline" if deadline <= time.time() else None


def _own_workdir(label: str, run_id: str, root: Path) -> Path | None:
    """The run's own work directory named by a container's label, or None. Only ever one
    the runner made for this run (`run-<run id>-...`) directly in its work area: a label
    naming `<root>/..`, a link out of the area or another run's directory is not ours
    to delete (the label comes from the engine, not from us)."""
    workdir = Path(label)
    if not label or ".." in workdir.parts or not workdir.name.startswith(f"run-{run_id}-"):
        return None
    try:
        if workdir.is_symlink() or workdir.resolve().parent != root.resolve():
            return None
    except OSError:
        return None
    return workdir
