"""Backends, chosen by name from one registry (like healthchecks' TRANSPORTS)."""

from __future__ import annotations

import importlib

from sandbox_runner.backends.base import Backend, BackendUnavailable, Handle

REGISTRY = {
    "docker": "sandbox_runner.backends.docker:DockerBackend",
    "bubblewrap": "sandbox_runner.backends.bubblewrap:BubblewrapBackend",
    "gvisor": "sandbox_runner.backends.docker:GvisorBackend",
}
# The backends that start an image: a run under one binds the image's id (RunSpec.image_id)
# or is refused (governance.services.sandbox: image_unresolved).
IMAGE_BACKENDS = frozenset({"docker", "gvisor"})
IMAGE_UNRESOLVED = "image_unresolved"  # governance's reason for refusing such a run


def get_backend(name: str) -> Backend:
    """The backend called `name`; BackendUnavailable if unknown or not usable here."""
    target = REGISTRY.get(name)
    if target is None:
        raise BackendUnavailable(f"no backend is called {name!r} (known: {', '.join(REGISTRY)})")
    module, _, cls = target.partition(":")
    backend: Backend = getattr(importlib.import_module(module), cls)()
    problem = backend.unavailable()
    if problem:
        raise BackendUnavailable(f"the {name} backend cannot run here: {problem}")
    return backend


__all__ = [
    "IMAGE_BACKENDS",
    "IMAGE_UNRESOLVED",
    "REGISTRY",
    "Backend",
    "BackendUnavailable",
    "Handle",
    "get_backend",
]
