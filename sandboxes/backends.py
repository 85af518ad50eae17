"""Choosing and making a sandbox backend: one place maps a spec's `backend` name to its class.

    sandbox = create_sandbox(SandboxSpec(backend="docker"))   # not started; `async with` starts it
    auto_backend(image)                                     # what backend="auto" means on this machine

Backends are imported only when used, so the docker SDK stays optional: "docker" (sandboxes/docker.py),
"local" (bubblewrap, sandboxes/local.py), "unsafe-subprocess" (no isolation, sandboxes/unsafe.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from sandboxes import errors
from sandboxes.base import BackendName, Sandbox, SandboxSpec


def create_sandbox(spec: SandboxSpec | None = None, **kwargs: Any) -> Sandbox:
    """A new (not yet started) sandbox of the spec's backend; backends are imported only when used."""
    spec = spec or SandboxSpec(**kwargs)
    if spec.backend == "auto":
        spec = dataclasses.replace(spec, backend=auto_backend(spec.image, spec.docker_engines))
    if spec.backend == "docker":
        from sandboxes.docker import DockerSandbox

        return DockerSandbox(spec)
    if spec.backend == "local":
        from sandboxes.local import LocalSandbox

        return LocalSandbox(spec)
    from sandboxes.unsafe import UnsafeSubprocessSandbox

    return UnsafeSubprocessSandbox(spec)


@functools.cache
def auto_backend(image: str, engines: tuple[str, ...] = ()) -> BackendName:
    """What backend="auto" means on this machine: "docker" when one of `engines` (none: DOCKER_HOST's)
    answers and has `image`, else "local" when bubblewrap is installed (decided once per process, image and
    engine list)."""
    import shutil

    problems = []
    for url in engines or ("",):
        try:
            from sandboxes.engine import docker_client

            docker_client(url).images.get(image)
            return "docker"
        except Exception as exc:  # no engine, no image, no docker SDK: all mean "not Docker here"
            problems.append(f"{type(exc).__name__}: {exc}")
    docker_problem = "; ".join(problems)
    if shutil.which("bwrap"):
        return "local"
    raise errors.EngineUnavailable(
        f"backend='auto' found neither Docker with image {image!r} ({docker_problem}) nor bubblewrap; "
        "start a Docker engine and run `harness sandbox build-image`, or apt-get install bubblewrap"
    )


__all__ = ["auto_backend", "create_sandbox"]
