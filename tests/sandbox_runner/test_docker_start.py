"""The engine's "cannot start an already running container" answer.

Under load dockerd can answer a start with 500 although the container did start
(moby#41296; seen once in CI, where the run was reported failed while its container
ran). start_container() asks the engine's own state before calling it a failure. The
race itself cannot be provoked on demand, so these tests put the engine's answer in
front of a real container: the start is real (or withheld), only the 500 is staged.
"""

from __future__ import annotations

from typing import Any

import docker.errors
import pytest

from sandbox_runner.backends.docker import start_container
from sandbox_runner.spec import DEFAULT_IMAGE

ALREADY_RUNNING = "OCI runtime start failed: cannot start an already running container: unknown"


class EngineAnswers500:
    """A real container whose start() answers like the racing engine: after starting
    it (`started=True`, the race) or without starting it (a real failure)."""

    def __init__(self, container: Any, *, started: bool, message: str = ALREADY_RUNNING) -> None:
        self.container = container
        self.started = started
        self.message = message

    def start(self) -> None:
        if self.started:
            self.container.start()
        raise docker.errors.APIError(f"500 Server Error: Internal Server Error ({self.message!r})")

    def reload(self) -> None:
        self.container.reload()

    @property
    def attrs(self) -> dict[str, Any]:
        return self.container.attrs


@pytest.fixture
def created(docker_client: Any) -> Any:
    container = docker_client.containers.create(
        DEFAULT_IMAGE, ["sleep", "30"], network_mode="none", labels={"test": "docker_start"}
    )
    yield container
    container.remove(force=True)


def test_a_start_the_engine_reports_failed_but_did_is_a_start(created: Any) -> None:
    start_container(EngineAnswers500(created, started=True))
    created.reload()
    assert created.attrs["State"]["Running"] is True


def test_a_container_that_ran_and_exited_counts_as_started(docker_client: Any) -> None:
    container = docker_client.containers.create(DEFAULT_IMAGE, ["true"], network_mode="none")
    try:
        container.start()
        assert container.wait()["StatusCode"] == 0
        container.reload()
        assert container.attrs["State"]["Running"] is False
        # The race, with the code already finished by the time the runner looks.
        wrapped = EngineAnswers500(container, started=False)
        start_container(wrapped)
    finally:
        container.remove(force=True)


def test_the_same_answer_for_a_container_that_never_started_is_an_error(created: Any) -> None:
    with pytest.raises(docker.errors.APIError, match="already running"):
        start_container(EngineAnswers500(created, started=False))
    created.reload()
    assert created.attrs["State"]["Status"] == "created"


def test_any_other_start_error_is_an_error_even_if_the_container_runs(created: Any) -> None:
    with pytest.raises(docker.errors.APIError, match="no such file"):
        start_container(EngineAnswers500(created, started=True, message="exec: no such file"))


@pytest.mark.parametrize("egress", [False, True], ids=["no-egress", "egress-holder"])
def test_a_start_that_fails_after_its_containers_are_made_leaves_none_behind(
    docker_client: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, egress: bool
) -> None:
    """Attaching to the sandbox (before it starts) can fail at the engine; the sandbox
    container, and the egress holder, stayed on the engine until the reaper's deadline:
    only a failed create was cleaned up. The containers are real; the engine's failure
    to attach is staged (it cannot be provoked on demand)."""
    import time

    import docker.models.containers

    from sandbox_runner.backends.docker import DockerBackend
    from sandbox_runner.spec import DEFAULT_LIMITS, Authorization, RunSpec
    from tests.sandbox_runner.conftest import containers_of

    def engine_fails(*args: Any, **kwargs: Any) -> Any:
        raise docker.errors.APIError("500 Server Error: attach failed (staged)")

    monkeypatch.setattr(docker.models.containers.Container, "attach", engine_fails)
    image_id = docker_client.images.get(DEFAULT_IMAGE).id
    spec = RunSpec(agent="coder", task=None, command=("true",), image_id=image_id)
    auth = Authorization("allow", "allowed", "", spec.run_id, limits=DEFAULT_LIMITS)
    network = (lambda *args: None) if egress else None
    with pytest.raises(docker.errors.APIError, match="staged"):
        DockerBackend(docker_client).start(
            spec, auth, tmp_path, time.time() + 60, lambda data: None, lambda data: None, network
        )
    assert containers_of(docker_client, spec.run_id) == []
