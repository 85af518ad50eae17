"""The warm sandbox pool: warm starts, caps under load, health checks, reuse, and closing."""

from __future__ import annotations

import os

import anyio
import pytest

from sandboxes import errors
from sandboxes.base import Limits, SandboxSpec
from sandboxes.pool import SandboxPool

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(backend="local", exec_timeout_s=30)


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def wait_for(condition, timeout_s: float = 10.0) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.01)


async def test_filler_starts_min_idle_ahead_of_demand_and_refills():
    async with SandboxPool(SPEC, min_idle=3, max_total=8) as pool:
        await wait_for(lambda: pool.size["idle"] == 3)
        async with pool.lease() as sandbox:
            assert (await sandbox.exec("echo ok")).stdout == "ok\n"
            await wait_for(lambda: pool.size["idle"] == 3)  # refilled while the lease is held
            assert pool.size["leased"] == 1
        assert pool.stats.started == 4


async def test_max_total_caps_sandboxes_under_a_burst_and_nothing_is_lost():
    in_use = 0
    most = 0

    async def rollout(pool: SandboxPool, index: int, done: list[int]) -> None:
        nonlocal in_use, most
        async with pool.lease() as sandbox:
            in_use += 1
            most = max(most, in_use)
            result = await sandbox.exec(f"echo {index} > mine && cat mine && ls | wc -l")
            assert result.stdout.split() == [str(index), "1"]  # a fresh working directory every time
            in_use -= 1
        done.append(index)

    done: list[int] = []
    async with SandboxPool(SPEC, max_total=4, max_starting=2) as pool:
        async with anyio.create_task_group() as group:
            for index in range(24):
                group.start_soon(rollout, pool, index, done)
        assert pool.stats.started == 24 and pool.stats.discarded == 24
        assert pool.size["total"] == 0
    assert sorted(done) == list(range(24))
    assert most <= 4


async def test_reuse_wipes_processes_and_files_between_leases():
    async with SandboxPool(SPEC, max_total=1, reuse=True) as pool:
        async with pool.lease() as first:
            await first.exec("echo secret > left.txt; mkdir d; setsid sleep 1000 &")
        async with pool.lease() as second:
            assert second is first
            listing = await second.exec("ls -A; pgrep sleep || echo no-sleep")
        assert listing.stdout == "no-sleep\n"
        assert pool.stats.reused == 2 and pool.stats.started == 1


async def test_a_dead_idle_sandbox_is_replaced_not_leased():
    async with SandboxPool(SPEC, max_total=2, reuse=True) as pool:
        async with pool.lease() as sandbox:
            pass
        os.killpg(sandbox._process.pid, 9)  # dies while idle
        await anyio.sleep(0.2)
        async with pool.lease() as replacement:
            assert replacement is not sandbox
            assert (await replacement.exec("echo fine")).stdout == "fine\n"
        assert pool.stats.unhealthy == 1


async def test_closing_the_pool_closes_leased_and_idle_sandboxes():
    pool = SandboxPool(SPEC, min_idle=2, max_total=4)
    async with pool:
        await wait_for(lambda: pool.size["idle"] == 2)
        leased = await pool.acquire()
    assert leased.closed
    assert pool.size["idle"] == 0
    with pytest.raises(errors.SandboxClosed):
        await pool.acquire()


@pytest.mark.docker
async def test_a_docker_pool_whose_image_no_engine_has_refuses_to_open_naming_it():
    missing = SandboxSpec(backend="docker", image="agent-harness/does-not-exist:never")
    with pytest.raises(errors.ImageNotFound, match=r"does-not-exist:never.*build-image"):
        async with SandboxPool(missing, max_total=1):
            pass


@pytest.mark.docker
async def test_start_failure_is_typed_and_gives_the_slot_back():
    broken = SandboxSpec(backend="docker", limits=Limits(cpus=4096))  # more CPUs than the engine has
    async with SandboxPool(broken, max_total=1) as pool:
        for _ in range(2):  # the slot came back: the second attempt does not wait forever
            with anyio.fail_after(60), pytest.raises(errors.SandboxStartError):
                await pool.acquire()
        assert pool.size["total"] == 0 and pool.stats.start_failures == 2


def test_impossible_pool_sizes_are_refused():
    with pytest.raises(errors.InvalidSandboxConfig, match="min_idle"):
        SandboxPool(SPEC, min_idle=5, max_total=2)


@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.docker)])
async def test_reuse_wipes_tmp_and_dev_shm_too(backend):
    spec = SandboxSpec(backend=backend, exec_timeout_s=30)
    async with SandboxPool(spec, max_total=1, reuse=True) as pool:
        async with pool.lease() as first:
            await first.exec("echo secret > /tmp/left.txt; mkdir -p /tmp/d; echo x > /dev/shm/left || true")
        async with pool.lease() as second:
            assert second is first
            listing = await second.exec("ls -A /tmp; ls -A /dev/shm 2>/dev/null; true")
        assert listing.stdout == ""
        assert pool.stats.reused == 2
