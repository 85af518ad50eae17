"""Sandboxes over several Docker engines: placement by free capacity under per-engine caps, the image copied
to an engine that lacks it, a stopped engine's sandboxes dying (and only those) while new ones go elsewhere,
the reaper sweeping every engine, nothing left on either.

The unit tests at the top place sandboxes on engines that do not exist (nothing is started). The docker tests
use two real engines: DOCKER_HOST's and the second one tests/run.sh starts (HARNESS_SECOND_ENGINE, with no
image until a test copies it there); one test stops the second engine mid-run and starts it again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import types
import uuid
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest

from sandboxes import errors, placement
from sandboxes.base import RUN_ID, Limits, SandboxSpec

SECOND = os.environ.get("HARNESS_SECOND_ENGINE", "")
SECOND_DIR = os.environ.get("HARNESS_SECOND_ENGINE_DIR", "")
TLS = os.environ.get("HARNESS_SECOND_ENGINE_TLS", "")
TLS_CERTS = os.environ.get("HARNESS_SECOND_ENGINE_CERTS", "")


@pytest.fixture
def second_engine() -> str:
    """The second engine's URL; skips without one, fails in CI (where tests/run.sh starts it)."""
    if not (SECOND and TLS):
        problem = "needs the second Docker engine tests/run.sh starts as root (HARNESS_SECOND_ENGINE)"
        if os.environ.get("CI"):
            pytest.fail(f"{problem}: in CI it should be there", pytrace=False)
        pytest.skip(problem)
    return SECOND


needs_second_engine = pytest.mark.usefixtures("second_engine")
SMALL = Limits(memory_mb=128, pids=64, disk_mb=16)


def fake_engines(*cpus: int) -> tuple[str, ...]:
    """Engines that exist only in placement's books, with the given CPU counts."""
    urls = tuple(f"unix:///nonexistent/{uuid.uuid4().hex[:8]}.sock" for _ in cpus)
    for url, count in zip(urls, cpus, strict=True):
        placement.engine(url).cpus = count
    return urls


# --- placement, no engine -------------------------------------------------------------------------------


def test_placement_fills_engines_in_proportion_to_their_cpus():
    big, small = fake_engines(6, 2)
    spec = SandboxSpec(backend="docker", docker_engines=(big, small), engine_max_starting=100)

    async def main():
        return [await placement.reserve(spec) for _ in range(40)]

    slots = anyio.run(main)
    on_big = sum(slot.engine.url == big for slot in slots)
    assert on_big == 30  # 6 of every 8 CPUs
    assert placement.snapshot((big, small))[placement.engine(small).name]["sandboxes"] == 10
    for slot in slots:
        slot.release()
        slot.release()  # idempotent
    assert placement.engine(big).num_sandboxes == placement.engine(small).num_sandboxes == 0


def test_placement_keeps_each_engine_under_its_caps_and_waits_for_a_free_slot():
    first, second = fake_engines(4, 4)
    spec = SandboxSpec(
        backend="docker",
        docker_engines=(first, second),
        engine_max_sandboxes=3,
        engine_max_starting=2,
        start_timeout_s=5,
    )

    async def main():
        starting = [await placement.reserve(spec) for _ in range(4)]
        assert [placement.engine(url).num_starting for url in (first, second)] == [2, 2]
        for slot in starting:
            slot.started()
        more = [await placement.reserve(spec) for _ in range(2)]  # the sixth fills both to 3
        assert [placement.engine(url).num_sandboxes for url in (first, second)] == [3, 3]
        waited = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(_release_later, starting[0], 0.3)
            seventh = await placement.reserve(spec)
        assert time.monotonic() - waited >= 0.25  # it waited for the release
        assert seventh.engine is starting[0].engine
        for slot in [*starting, *more, seventh]:
            slot.release()

    anyio.run(main)


async def _release_later(slot: placement.Slot, delay_s: float) -> None:
    await anyio.sleep(delay_s)
    slot.release()


def test_placement_at_the_caps_past_the_start_timeout_names_the_caps():
    (only,) = fake_engines(1)
    spec = SandboxSpec(backend="docker", docker_engines=(only,), engine_max_sandboxes=1, start_timeout_s=0.2)

    async def main():
        held = await placement.reserve(spec)
        with pytest.raises(errors.SandboxStartError, match="engine_max_sandboxes=1"):
            await placement.reserve(spec)
        held.release()

    anyio.run(main)


def test_a_lost_engine_gets_no_sandbox_and_all_lost_is_a_clear_error():
    first, second = fake_engines(2, 2)
    spec = SandboxSpec(backend="docker", docker_engines=(first, second), engine_max_starting=100)
    placement.mark_lost(first, "ConnectionRefusedError: nobody there")

    async def main():
        slots = [await placement.reserve(spec) for _ in range(5)]
        assert {slot.engine.url for slot in slots} == {second}
        placement.mark_lost(second, "ConnectionRefusedError: nobody there either")
        with pytest.raises(errors.EngineUnavailable, match="none of the 2 Docker engines answers"):
            await placement.reserve(spec)
        for slot in slots:
            slot.release()

    anyio.run(main)
    assert placement.engine(first).num_lost == 1
    placement.engine(first).retry_at = 0  # due: a probe of a socket that does not exist keeps it lost
    with pytest.raises(errors.EngineUnavailable):
        anyio.run(placement.reserve, spec)
    assert placement.engine(first).lost and placement.engine(first).num_lost == 1


@pytest.mark.parametrize(
    ("engines", "problem"),
    [
        (("docker.sock",), "is not an engine URL"),
        (("unix:///a.sock", "unix:///a.sock"), "names an engine twice"),
    ],
)
def test_a_spec_with_bad_engine_urls_is_refused_naming_them(engines, problem):
    with pytest.raises(errors.InvalidSandboxConfig, match=problem):
        SandboxSpec(backend="docker", docker_engines=engines)


def test_a_spec_takes_engines_as_a_comma_separated_string():
    spec = SandboxSpec(backend="docker", docker_engines="unix:///a.sock,tcp://10.0.0.2:2376")  # type: ignore[arg-type]
    assert spec.docker_engines == ("unix:///a.sock", "tcp://10.0.0.2:2376")
    hash(spec)


class RemovingApi:
    """The docker SDK's low-level API as far as remove_container uses it, failing the first `failures`
    removals as dockerd does while a container's mounts are still being torn down."""

    def __init__(self, failures: int, explanation: str):
        self.failures, self.explanation, self.calls = failures, explanation, 0

    def remove_container(self, container_id: str, force: bool) -> None:
        import docker

        self.calls += 1
        if self.calls <= self.failures:
            url = f"http+docker://localhost/v1.41/containers/{container_id}"
            response = types.SimpleNamespace(status_code=500, reason="Internal Server Error", url=url)
            raise docker.errors.APIError("500 Server Error", response=response, explanation=self.explanation)


BUSY_FILESYSTEM = (
    "unable to remove filesystem for c6ee26e8: unlinkat /data/containers/c6ee26e8: directory not empty"
)


@pytest.mark.parametrize(
    ("failures", "explanation", "calls", "raises"),
    [
        (2, BUSY_FILESYSTEM, 3, False),  # tried again until the engine lets it go
        (9, BUSY_FILESYSTEM, 5, True),  # not forever: the last error is raised
        (1, "driver failed", 1, True),  # any other engine error at once
    ],
)
def test_a_removal_the_engine_fails_while_unmounting_is_tried_again(
    monkeypatch, failures, explanation, calls, raises
):
    import docker

    from sandboxes import engine

    monkeypatch.setattr(engine, "REMOVE_RETRY_DELAYS_S", (0.01, 0.01, 0.01, 0.01))
    api = RemovingApi(failures, explanation)
    client = types.SimpleNamespace(api=api)
    if raises:
        with pytest.raises(docker.errors.APIError, match="500"):
            engine.remove_container(client, "c6ee26e8")
    else:
        engine.remove_container(client, "c6ee26e8")
    assert api.calls == calls


# --- two real engines -----------------------------------------------------------------------------------


def our_containers(url: str) -> list[dict]:
    from sandboxes.engine import LABELS, docker_client

    return docker_client(url).api.containers(all=True, filters={"label": f"{LABELS['run_id']}={RUN_ID}"})


@pytest.mark.docker
@needs_second_engine
def test_a_pool_copies_the_image_to_an_engine_that_lacks_it():
    import docker

    from sandboxes.engine import docker_client
    from sandboxes.pool import SandboxPool

    spec = SandboxSpec(backend="docker", docker_engines=("", SECOND), limits=SMALL)
    second = docker_client(SECOND)
    for container in our_containers(SECOND):
        second.api.remove_container(container["Id"], force=True)
    with contextlib.suppress(docker.errors.ImageNotFound):
        second.images.remove(spec.image, force=True)
    assert not second.images.list(name=spec.image)

    async def main():
        async with SandboxPool(spec, max_total=4) as pool:
            assert second.images.list(name=spec.image)  # copied when the pool opened
            async with pool.lease() as a, pool.lease() as b:
                assert {a.engine_url, b.engine_url} == {"", SECOND}  # one each
                results = [await sandbox.exec("cat /etc/debian_version") for sandbox in (a, b)]
                assert results[0].stdout == results[1].stdout != ""

    anyio.run(main)
    assert not our_containers("") and not our_containers(SECOND)


@pytest.mark.docker
@needs_second_engine
def test_reap_sweeps_every_engine_named(capsys):
    import docker

    from harness.cli import main
    from sandboxes.engine import LABELS, docker_client
    from sandboxes.owner import Owner, this_owner

    me = this_owner()
    dead = Owner(me.host, me.pid, me.start_ticks + 3)  # this pid, another start: a process that is gone
    labels = {
        LABELS["managed"]: "1",
        LABELS["run_id"]: "dead-run",
        LABELS["owner_host"]: dead.host,
        LABELS["owner_pid"]: str(dead.pid),
        LABELS["owner_start"]: str(dead.start_ticks),
        LABELS["created_at"]: datetime.now(UTC).isoformat(timespec="seconds"),
    }
    image = SandboxSpec().image
    placement_spec = SandboxSpec(backend="docker", docker_engines=("", SECOND))
    anyio.run(placement.prepare, placement_spec)  # the image on both
    made = {
        url: docker_client(url).containers.create(image, command=["true"], labels=labels, network_mode="none")
        for url in ("", SECOND)
    }
    try:
        default = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        assert main(["sandbox", "reap", "--engine", SECOND, "--engine", default]) == 0
        out = capsys.readouterr().out
        for url, container in made.items():
            assert f"removed container {container.name} on" in out
            assert not docker_client(url).api.containers(all=True, filters={"id": container.id})
    finally:
        for url, container in made.items():
            with contextlib.suppress(docker.errors.NotFound):
                docker_client(url).api.remove_container(container.id, force=True)


@pytest.mark.docker
@needs_second_engine
def test_sandboxes_on_an_engine_reached_over_tcp_with_mutual_tls(monkeypatch):
    from sandboxes.backends import create_sandbox
    from sandboxes.pool import SandboxPool

    spec = SandboxSpec(backend="docker", docker_engines=(TLS,), limits=SMALL)
    monkeypatch.delenv("DOCKER_TLS_VERIFY", raising=False)
    monkeypatch.delenv("DOCKER_CERT_PATH", raising=False)
    with pytest.raises(errors.EngineUnavailable, match=TLS):  # no client certificate: refused
        anyio.run(create_sandbox(spec).start)

    monkeypatch.setenv("DOCKER_TLS_VERIFY", "1")
    monkeypatch.setenv("DOCKER_CERT_PATH", TLS_CERTS)

    async def main():
        async with SandboxPool(spec, max_total=2) as pool, pool.lease() as sandbox:
            assert sandbox.engine_url == TLS
            assert (await sandbox.exec("cat", stdin="over tls")).stdout == "over tls"
            big = await sandbox.exec("head -c 600000 /dev/zero | tr '\\0' x")  # many TLS records
            assert big.stdout == "x" * 600_000

    anyio.run(main)
    assert not placement.engine(TLS).lost
    assert not our_containers(SECOND)


def stop_engine(engine_dir: str) -> list[str]:
    """SIGTERM the engine's dockerd and wait until it is gone; return its command line, to start it again."""
    pid = int(Path(engine_dir, "docker.pid").read_text())
    command = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1]
        except OSError:  # it ended (and was reaped) between the two reads: ESRCH or ENOENT
            break
        if state.startswith("Z"):
            break
        time.sleep(0.1)
    assert time.monotonic() < deadline, "dockerd did not stop within 60 s"
    return command


def start_engine(engine_dir: str, command: list[str]) -> None:
    """Start a stopped engine again with its own command line; tests/run.sh stops it by its pidfile."""
    import docker

    with open(Path(engine_dir, "dockerd.log"), "ab") as log:
        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            docker.DockerClient(base_url=SECOND, timeout=5).ping()
            return
        except Exception:
            assert time.monotonic() < deadline, "the restarted dockerd did not answer within 60 s"
            time.sleep(0.2)


@pytest.mark.docker
@pytest.mark.slow
@needs_second_engine
def test_256_sandboxes_over_two_engines_one_stopped_mid_run():
    """256 sandboxes spread over both engines, each busy; the second engine is stopped: exactly its
    sandboxes die (SandboxDied), the first's keep working, new sandboxes go to the first; once the second is
    back its containers are removed, and nothing of ours is left on either engine."""
    from sandboxes.pool import SandboxPool

    spec = SandboxSpec(
        backend="docker",
        docker_engines=("", SECOND),
        limits=SMALL,
        engine_max_starting=16,
        start_timeout_s=120,
    )
    outcomes: dict[str, str] = {}

    async def main():
        async with SandboxPool(spec, max_total=320, max_starting=32) as pool:
            sandboxes = []
            async with anyio.create_task_group() as group:
                for _ in range(256):
                    group.start_soon(lambda: _acquire_into(pool, sandboxes))
            by_engine = {url: [s for s in sandboxes if s.engine_url == url] for url in ("", SECOND)}
            assert len(by_engine[""]) + len(by_engine[SECOND]) == 256
            assert min(len(by_engine[""]), len(by_engine[SECOND])) >= 96  # spread, not piled on one
            assert len(our_containers(SECOND)) == len(by_engine[SECOND])
            async with anyio.create_task_group() as group:  # every one answers before the stop
                for sandbox in sandboxes:
                    group.start_soon(_expect_answer, sandbox)

            command = await anyio.to_thread.run_sync(stop_engine, SECOND_DIR)
            async with anyio.create_task_group() as group:
                for sandbox in sandboxes:
                    group.start_soon(_record_outcome, sandbox, outcomes)
            died = {name for name, outcome in outcomes.items() if outcome == "died"}
            assert died == {sandbox.name for sandbox in by_engine[SECOND]}
            assert all(outcomes[s.name] == "ok" for s in by_engine[""])
            assert placement.engine(SECOND).lost

            async with pool.lease() as fresh:  # new sandboxes go to the engine that answers
                assert fresh.engine_url == ""
                assert (await fresh.exec("echo fresh")).stdout == "fresh\n"
            for sandbox in sandboxes:
                await pool.release(sandbox)
            assert len(placement.engine(SECOND).orphans) == len(by_engine[SECOND])

            await anyio.to_thread.run_sync(start_engine, SECOND_DIR, command)
            placement.engine(SECOND).retry_at = 0  # due now rather than in RETRY_LOST_S
        # closing the pool probed the engine again and removed its containers
        assert not placement.engine(SECOND).lost
        assert not placement.engine(SECOND).orphans

    anyio.run(main)
    assert not our_containers("")
    assert not our_containers(SECOND)
    assert placement.engine("").num_sandboxes == placement.engine(SECOND).num_sandboxes == 0


async def _acquire_into(pool, sandboxes: list) -> None:
    sandboxes.append(await pool.acquire())


async def _expect_answer(sandbox) -> None:
    result = await sandbox.exec("echo $((6 * 7))", timeout_s=60)
    assert result.stdout == "42\n", result


async def _record_outcome(sandbox, outcomes: dict[str, str]) -> None:
    try:
        result = await sandbox.exec("echo $((6 * 7))", timeout_s=60)
        outcomes[sandbox.name] = "ok" if result.stdout == "42\n" else f"wrong: {result}"
    except errors.SandboxDied:
        outcomes[sandbox.name] = "died"
