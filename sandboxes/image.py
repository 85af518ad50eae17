"""The sandbox base image: Debian with Python, built with debootstrap and imported into Docker.

Sandbox containers start from `DEFAULT_IMAGE`: a minimal Debian root filesystem with `python3`, a
non-root user `sandbox` (uid/gid 1000) and `/workspace` as its home and working directory. No
container registry is needed to make it: `build_base_image` bootstraps the root filesystem from a
Debian package mirror and imports it as an image. The packed root filesystem is cached on disk, so a
fresh engine (a CI run, a new machine with the same home) gets the image in seconds.

Used by `harness sandbox build-image` (harness/cli.py), by the test runner (tests/run.sh, through that
command) and by the sandbox backends, which expect the image to exist. `build_from_dockerfile` and
`pull_image` cover machines where a registry is reachable.

The docker SDK is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_IMAGE = "agent-harness/python:bookworm"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"

# Part of the cache key: bump it whenever the root filesystem recipe below changes, so tarballs built by
# an older recipe are not imported under the new one.
RECIPE_VERSION = 1

SANDBOX_USER = "sandbox"
SANDBOX_UID = 1000
SANDBOX_GID = 1000
WORKSPACE = "/workspace"

# Dockerfile instructions applied at import: an imported root filesystem has no config of its own.
IMAGE_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    f"WORKDIR {WORKSPACE}",
    f"USER {SANDBOX_UID}:{SANDBOX_GID}",
    # Without a CMD, `docker run IMAGE` with no command is refused.
    'CMD ["/bin/bash"]',
)

# Removed from the root filesystem to keep the image small. The build host's hostname and resolver
# config that debootstrap copies in are dropped too: Docker mounts its own.
_SLIM_GLOBS = (
    "var/cache/apt/archives/*.deb",
    "var/cache/apt/*.bin",
    "var/lib/apt/lists/*",
    "usr/share/doc/*",
    "usr/share/man/*",
    "usr/share/info/*",
    "usr/share/locale/*",
    "var/log/bootstrap.log",
    "etc/hostname",
    "etc/resolv.conf",
)

_START_ENGINE_HINT = (
    "start one (as root: `systemctl start docker`, or `dockerd &`) or point DOCKER_HOST at a running "
    "engine; for the tests, `bash tests/run.sh` starts its own"
)

Log = Callable[[str], Any]


class ImageError(RuntimeError):
    """An image could not be built, imported or pulled; the message says why and what to do."""


def build_base_image(
    tag: str = DEFAULT_IMAGE,
    *,
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    extra_packages: Sequence[str] = (),
    client: Any = None,
    force: bool = False,
    cache_dir: Path | None = None,
    log: Log = print,
) -> str:
    """Make sure the engine has the base image `tag`, building it if needed; return `tag`.

    An existing `tag` is kept unless `force`. Otherwise the root filesystem comes from the cache in
    `cache_dir` (see `default_cache_dir`), or from debootstrap when the cache has none for this suite
    and package set. `force` re-imports but still reuses the cached root filesystem: delete the cached
    tarball (see `cached_rootfs_path`) to bootstrap afresh, e.g. for security updates.
    """
    client = client if client is not None else connect()
    if not force and image_exists(client, tag):
        log(f"image {tag} already exists")
        return tag
    tarball = rootfs_tarball(
        suite=suite, mirror=mirror, extra_packages=extra_packages, cache_dir=cache_dir, log=log
    )
    _import_rootfs(client, tarball, tag, log)
    return tag


def rootfs_tarball(
    *,
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    extra_packages: Sequence[str] = (),
    cache_dir: Path | None = None,
    log: Log = print,
) -> Path:
    """Return the cached root filesystem tarball for `suite` and the packages, bootstrapping it if absent."""
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    path = cached_rootfs_path(cache_dir, suite, extra_packages)
    if path.is_file():
        log(f"using the cached root filesystem {path}")
        return path
    debootstrap = _require_debootstrap()
    cache_dir.mkdir(parents=True, exist_ok=True)
    # The work dir lives beside the cache: the finished tarball is then renamed into place atomically, and
    # debootstrap gets a filesystem that allows device nodes (/tmp is nodev on some machines).
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
    try:
        rootfs = work / "rootfs"
        _run_debootstrap(debootstrap, suite, mirror, _packages(extra_packages), rootfs, log)
        add_sandbox_user(rootfs)
        _slim(rootfs)
        partial = work / path.name
        _pack(rootfs, partial)
        os.replace(partial, path)
    finally:
        _remove_tree(work)
    log(f"cached the root filesystem as {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return path


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/agent-harness/images`, or `~/.cache/agent-harness/images`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agent-harness" / "images"


def cached_rootfs_path(cache_dir: Path, suite: str, extra_packages: Iterable[str] = ()) -> Path:
    """Where the tarball for this suite and package set is cached; the name changes with the recipe."""
    packages = _packages(extra_packages)
    key = {"recipe": RECIPE_VERSION, "suite": suite, "packages": packages, "arch": platform.machine()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"debian-{suite}-{digest}.tar.gz"


def add_sandbox_user(rootfs: Path) -> None:
    """Add the user and group `sandbox` (1000:1000) with home `/workspace` to a root filesystem."""
    etc = rootfs / "etc"
    name, uid, gid = SANDBOX_USER, SANDBOX_UID, SANDBOX_GID
    _append_entry(etc / "passwd", name, f"{name}:x:{uid}:{gid}:{name}:{WORKSPACE}:/bin/bash")
    _append_entry(etc / "group", name, f"{name}:x:{gid}:")
    # Locked password; entries in the shadow files keep tools such as pwck and su consistent.
    _append_entry(etc / "shadow", name, f"{name}:!:::::::")
    _append_entry(etc / "gshadow", name, f"{name}:!::")
    workspace = rootfs / WORKSPACE.lstrip("/")
    workspace.mkdir(exist_ok=True)
    os.chown(workspace, uid, gid)
    workspace.chmod(0o755)  # explicit: mkdir's mode is filtered by the umask


def connect(timeout: int = 60) -> Any:
    """A docker client for the engine of DOCKER_HOST (or the default socket), checked to answer."""
    import docker
    import requests

    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except (docker.errors.DockerException, requests.RequestException) as exc:
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        raise ImageError(f"no Docker engine answers at {where} ({exc}); {_START_ENGINE_HINT}") from exc
    return client


def image_exists(client: Any, tag: str) -> bool:
    """Whether the engine has an image named `tag`."""
    import docker

    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def build_from_dockerfile(path: str | Path, tag: str, client: Any = None, *, nocache: bool = False) -> str:
    """Build `tag` from a Dockerfile (a file, or a directory holding `Dockerfile`); return `tag`.

    The Dockerfile's directory is the build context. Its FROM image must exist locally or come from a
    reachable registry; `FROM agent-harness/python:bookworm` works offline once the base image is built.
    """
    import docker

    path = Path(path)
    dockerfile = path / "Dockerfile" if path.is_dir() else path
    if not dockerfile.is_file():
        raise ImageError(f"no Dockerfile at {path}")
    client = client if client is not None else connect()
    try:
        client.images.build(
            path=str(dockerfile.parent.resolve()),
            dockerfile=dockerfile.name,
            tag=tag,
            rm=True,
            forcerm=True,
            nocache=nocache,
        )
    except docker.errors.BuildError as exc:
        raise ImageError(
            f"building {tag} from {dockerfile} failed: {exc.msg}\n{_build_log_tail(exc.build_log)}\n"
            f"(a FROM image from an unreachable registry fails here: build {DEFAULT_IMAGE} with "
            "`harness sandbox build-image` and start from it)"
        ) from exc
    except docker.errors.APIError as exc:
        raise ImageError(f"building {tag} from {dockerfile} failed: {exc.explanation or exc}") from exc
    return tag


def pull_image(name: str, client: Any = None, *, tag: str | None = None) -> str:
    """Pull `name` from its registry, and tag it as `tag` too when given; return the name it has now."""
    import docker
    from docker.utils import parse_repository_tag

    client = client if client is not None else connect()
    repository, reference = parse_repository_tag(name)
    try:
        image = client.images.pull(repository, tag=reference or "latest")
    except docker.errors.APIError as exc:
        raise ImageError(
            f"could not pull {name}: {exc.explanation or exc}\n(is its registry reachable from the engine? "
            f"`harness sandbox build-image` builds {DEFAULT_IMAGE} without one)"
        ) from exc
    if tag is None:
        return name
    image.tag(*_split_tag(tag))
    return tag


def _packages(extra_packages: Iterable[str]) -> list[str]:
    # Sorted and deduplicated: the cache key must not depend on the order packages were asked for in.
    return sorted({"python3", *extra_packages})


def _require_debootstrap() -> str:
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise ImageError(
            "debootstrap is not installed; it builds the image's root filesystem: install it with "
            "`apt-get install debootstrap` (Debian/Ubuntu, as root)"
        )
    if os.geteuid() != 0:
        raise ImageError(
            "debootstrap needs root to build the root filesystem: run this as root (or with sudo)"
        )
    return debootstrap


def _run_debootstrap(
    debootstrap: str, suite: str, mirror: str, packages: Sequence[str], rootfs: Path, log: Log
) -> None:
    command = [
        debootstrap,
        "--variant=minbase",
        f"--include={','.join(packages)}",
        suite,
        str(rootfs),
        mirror,
    ]
    log(f"running {' '.join(command)} (takes about a minute)")
    result = subprocess.run(command, capture_output=True, text=True, errors="replace", check=False)
    if result.returncode == 0:
        return
    # debootstrap's own log holds the detail behind "Failure trying to run ..."; it goes with the work dir.
    details = _tail(result.stderr or result.stdout, 20)
    own_log = rootfs / "debootstrap" / "debootstrap.log"
    if own_log.is_file():
        details += "\n--- debootstrap.log (tail) ---\n" + _tail(own_log.read_text(errors="replace"), 20)
    raise ImageError(f"debootstrap failed (exit {result.returncode}) for {suite} from {mirror}:\n{details}")


def _slim(rootfs: Path) -> None:
    for pattern in _SLIM_GLOBS:
        for path in rootfs.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def _pack(rootfs: Path, tarball: Path) -> None:
    # GNU tar, not Python's tarfile: it keeps xattrs (file capabilities) and is several times faster.
    # gzip -1 shrinks the cache about 2.5x for 2 s; Docker imports gzipped tarballs as they are.
    command = [
        "tar",
        "--create",
        f"--file={tarball}",
        "--use-compress-program=gzip -1",
        "--numeric-owner",
        "--xattrs",
        "--sort=name",
        # Docker provides /dev, /proc and /sys in each container; device nodes would only bloat the layer.
        "--exclude=./dev/*",
        "--exclude=./proc/*",
        "--exclude=./sys/*",
        f"--directory={rootfs}",
        ".",
    ]
    result = subprocess.run(command, capture_output=True, text=True, errors="replace", check=False)
    if result.returncode != 0:
        raise ImageError(f"packing the root filesystem failed: {_tail(result.stderr, 10)}")


def _import_rootfs(client: Any, tarball: Path, tag: str, log: Log) -> None:
    import docker

    repository, image_tag = _split_tag(tag)
    log(f"importing {tarball} as {tag}")
    try:
        # Streams the file to the engine rather than reading it into memory.
        response = client.api.import_image_from_file(
            str(tarball), repository=repository, tag=image_tag, changes=list(IMAGE_CHANGES)
        )
    except docker.errors.APIError as exc:
        raise ImageError(f"importing {tarball} as {tag} failed: {exc.explanation or exc}") from exc
    # The engine reports some failures inside a 200 response, as JSON messages with an "error" key.
    for line in str(response).splitlines():
        message = json.loads(line) if line.strip().startswith("{") else {}
        if "error" in message:
            raise ImageError(f"importing {tarball} as {tag} failed: {message['error']}")
    if not image_exists(client, tag):
        raise ImageError(f"importing {tarball} as {tag} reported no error, yet the engine has no {tag}")


def _split_tag(tag: str) -> tuple[str, str]:
    from docker.utils import parse_repository_tag

    repository, image_tag = parse_repository_tag(tag)
    return repository, image_tag or "latest"


def _append_entry(path: Path, name: str, line: str) -> None:
    text = path.read_text() if path.exists() else ""
    if any(entry.split(":", 1)[0] == name for entry in text.splitlines()):
        return  # already there: keeps the recipe idempotent
    if text and not text.endswith("\n"):
        text += "\n"
    path.write_text(text + line + "\n")


def _remove_tree(path: Path) -> None:
    # An interrupted debootstrap can leave /proc or /sys mounted inside the root filesystem (and in a
    # container it bind-mounts the host's /dev there): unmount first, or rmtree would walk into them.
    for mount_point in sorted(_mounts_under(path), reverse=True):
        subprocess.run(["umount", "--lazy", mount_point], capture_output=True, check=False)
    shutil.rmtree(path, ignore_errors=True)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    # The kernel writes space, tab, newline and backslash in mount points as octal escapes (\040).
    points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[1]) for line in lines]
    return [point for point in points if point.startswith(prefix)]


def _build_log_tail(build_log: Iterable[dict[str, Any]], lines: int = 15) -> str:
    text = "".join(str(entry.get("stream") or entry.get("error") or "") for entry in build_log)
    return _tail(text, lines)


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
