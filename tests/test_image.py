"""The sandbox base image: the build recipe and its errors, and the real image in a real Docker engine.

Tests marked `docker` use the engine of DOCKER_HOST; tests/run.sh starts one and builds the image first.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import uuid

import pytest

from harness.cli import _SANDBOX_IMAGE, main
from sandboxes import image as image_module
from sandboxes.image import (
    DEFAULT_IMAGE,
    ImageError,
    add_sandbox_user,
    build_base_image,
    build_from_dockerfile,
    cached_rootfs_path,
    connect,
    pull_image,
    rootfs_tarball,
)

needs_root_and_debootstrap = pytest.mark.skipif(
    shutil.which("debootstrap") is None or os.geteuid() != 0, reason="needs debootstrap and root"
)


def _forbid_debootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("debootstrap ran")

    monkeypatch.setattr(image_module, "_run_debootstrap", fail)


# --- the recipe, without Docker -------------------------------------------------------------------------


def test_cli_default_tag_is_the_default_image():
    assert _SANDBOX_IMAGE == DEFAULT_IMAGE


def test_cache_key_follows_suite_and_package_set_not_their_order(tmp_path):
    path = cached_rootfs_path(tmp_path, "bookworm", ["git", "curl"])
    assert path.parent == tmp_path
    assert path.name.startswith("debian-bookworm-") and path.name.endswith(".tar.gz")
    assert path == cached_rootfs_path(tmp_path, "bookworm", ["curl", "git", "git", "python3"])
    assert path != cached_rootfs_path(tmp_path, "bookworm", ["curl"])
    assert path != cached_rootfs_path(tmp_path, "trixie", ["git", "curl"])


def test_default_cache_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert image_module.default_cache_dir() == tmp_path / "agent-harness" / "images"


def test_missing_debootstrap_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    cache = tmp_path / "cache"
    with pytest.raises(ImageError, match=r"apt-get install debootstrap"):
        rootfs_tarball(cache_dir=cache, log=lambda _: None)
    assert not cache.exists()


@needs_root_and_debootstrap
def test_bad_mirror_reports_debootstrap_stderr_and_cleans_up(tmp_path):
    # Nothing listens on port 9 of the loopback: debootstrap fails at once on the Release file.
    with pytest.raises(ImageError, match=r"debootstrap failed") as failure:
        rootfs_tarball(mirror="http://127.0.0.1:9/debian", cache_dir=tmp_path, log=lambda _: None)
    assert "Release" in str(failure.value)  # debootstrap's own words come along
    assert list(tmp_path.iterdir()) == []  # neither the work dir nor a partial tarball is left


def test_no_engine_names_how_to_start_one(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(ImageError, match=r"no Docker engine answers.*dockerd"):
        connect(timeout=5)
    _forbid_debootstrap(monkeypatch)  # the engine is asked first: no minute of debootstrap before failing
    with pytest.raises(ImageError, match=r"no Docker engine answers"):
        build_base_image("agent-harness/test:none", cache_dir=tmp_path, log=lambda _: None)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to uid 1000 needs root")
def test_sandbox_user_is_added_once_with_its_workspace(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:")  # no final newline: the entry must still go on its own line
    add_sandbox_user(tmp_path)
    add_sandbox_user(tmp_path)
    assert (etc / "passwd").read_text().splitlines()[1:] == [
        "sandbox:x:1000:1000:sandbox:/workspace:/bin/bash"
    ]
    assert (etc / "group").read_text().splitlines() == ["root:x:0:", "sandbox:x:1000:"]
    assert (etc / "shadow").read_text() == "sandbox:!:::::::\n"
    stat = (tmp_path / "workspace").stat()
    assert (stat.st_uid, stat.st_gid, stat.st_mode & 0o777) == (1000, 1000, 0o755)


def test_cli_reports_image_errors_and_rejects_mixed_sources(monkeypatch, capsys):
    def fail(*args: object, **kwargs: object) -> str:
        raise ImageError("debootstrap is not installed")

    monkeypatch.setattr(image_module, "build_base_image", fail)
    assert main(["sandbox", "build-image"]) == 1
    assert "error: debootstrap is not installed" in capsys.readouterr().err
    assert main(["sandbox", "build-image", "--pull", "python:3.11", "--package", "git"]) == 2
    assert "--package: only for the debootstrap build" in capsys.readouterr().err


# --- the real image in a real engine --------------------------------------------------------------------


@pytest.fixture(scope="session")
def client():
    import docker

    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture(scope="session")
def base_image(client) -> str:
    """The default image; tests/run.sh has built it already, so this only checks that it exists."""
    return build_base_image(DEFAULT_IMAGE, client=client)


@pytest.fixture
def scratch_tag(client):
    """A unique throwaway image name, removed after the test."""
    tag = f"agent-harness/test-{uuid.uuid4().hex[:12]}:latest"
    yield tag
    if image_module.image_exists(client, tag):
        client.images.remove(tag, force=True)


def _run(client, image: str, command: list[str]) -> str:
    output = client.containers.run(image, command, network_mode="none", remove=True)
    return output.decode().strip()


@pytest.mark.docker
def test_base_image_is_small_and_configured_for_the_sandbox_user(client, base_image):
    attrs = client.images.get(base_image).attrs
    config = attrs["Config"]
    assert config["User"] == "1000:1000"
    assert config["WorkingDir"] == "/workspace"
    assert "LANG=C.UTF-8" in config["Env"]
    assert attrs["Size"] < 200 * 2**20  # about 120 MB; docs, manuals and apt caches are gone


@pytest.mark.docker
def test_python_runs_as_uid_1000_in_workspace(client, base_image):
    code = "import os, sys; print(os.getuid(), sys.version_info[:2], os.getcwd())"
    assert _run(client, base_image, ["python3", "-c", code]) == "1000 (3, 11) /workspace"


@pytest.mark.docker
def test_sandbox_user_owns_its_workspace(client, base_image):
    assert _run(client, base_image, ["id", "-un"]) == "sandbox"
    assert _run(client, base_image, ["stat", "-c", "%U:%G %a", "/workspace"]) == "sandbox:sandbox 755"


@pytest.mark.docker
def test_existing_image_is_kept_without_rebuilding(client, base_image, monkeypatch, tmp_path):
    before = client.images.get(base_image).id
    _forbid_debootstrap(monkeypatch)
    monkeypatch.setattr(image_module, "_import_rootfs", lambda *args: pytest.fail("re-imported"))
    assert build_base_image(base_image, client=client, cache_dir=tmp_path, log=lambda _: None) == base_image
    assert client.images.get(base_image).id == before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.docker
def test_cached_rootfs_is_imported_without_debootstrap(client, scratch_tag, monkeypatch, tmp_path):
    # A stand-in root filesystem of one file under the cache's name for the default recipe.
    tarball = cached_rootfs_path(tmp_path, "bookworm")
    with tarfile.open(tarball, "w:gz") as tar:
        info = tarfile.TarInfo("etc/marker")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
    _forbid_debootstrap(monkeypatch)
    assert build_base_image(scratch_tag, client=client, cache_dir=tmp_path, log=lambda _: None) == scratch_tag
    config = client.images.get(scratch_tag).attrs["Config"]
    assert (config["User"], config["WorkingDir"], config["Cmd"]) == ("1000:1000", "/workspace", ["/bin/bash"])


@pytest.mark.docker
def test_dockerfile_build_from_the_base_image_works_offline(client, base_image, scratch_tag, tmp_path):
    (tmp_path / "hello.txt").write_text("hello\n")
    (tmp_path / "Dockerfile").write_text(f"FROM {base_image}\nCOPY hello.txt /workspace/\n")
    assert build_from_dockerfile(tmp_path, scratch_tag, client=client) == scratch_tag
    assert _run(client, scratch_tag, ["cat", "hello.txt"]) == "hello"


@pytest.mark.docker
def test_dockerfile_errors_are_clear(client, tmp_path):
    with pytest.raises(ImageError, match=r"no Dockerfile at"):
        build_from_dockerfile(tmp_path, "agent-harness/test:none", client=client)
    (tmp_path / "Dockerfile").write_text(f"FROM {DEFAULT_IMAGE}\nRUN exit 3\n")
    with pytest.raises(ImageError, match=r"failed"):
        build_from_dockerfile(tmp_path, "agent-harness/test:none", client=client)


@pytest.mark.docker
def test_pull_from_an_unknown_registry_is_a_clear_error(client):
    # `.invalid` never resolves (RFC 2606), so this fails fast with or without a network.
    with pytest.raises(ImageError, match=r"could not pull registry\.invalid/none:1"):
        pull_image("registry.invalid/none:1", client=client)
