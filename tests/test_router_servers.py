"""GenerationRouter against two real built-in servers (`harness serve` on CPU, the tiny random Qwen3).

What several servers promise a run: requests spread by load and a group stays on one server (checked
against each server's own request counter, vllm:request_success_total), pause, resume and a weight
update reach both (their served log-probs become the new model's), a server killed mid-run has its
in-flight turns finished on the other with nothing lost and the drop counted, with both killed the run
stops with an error naming them, a server killed and restarted mid-run is routed to again only after the
next weight sync took it back (and then serves the synced policy), and a drop recorded by the trainer's
router stops routing in a spawned process holding the same server states. The router records where it
placed each request (`RecordingRouter`); everything else is the real loop, client, weight sync and servers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
import types
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlparse

import anyio
import pytest
import torch
from test_rollout_faults import ONE_PASS, RecordingLoop, _leaves, all_rollouts, random_reward
from test_rollout_loop import make_loop, metrics, prompt_rows

from harness.generation.client import GenerationClient
from harness.generation.client_thread import ClientThread
from harness.generation.protocol import AllServersUnavailableError, Completion, SamplingConfig
from harness.generation.router import GenerationRouter
from harness.generation.server_load import parse_prometheus
from harness.generation.server_states import ServerStates
from harness.server.launch import BuiltinServer, start_builtin_server

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def builtin_server(model_dir: str, log_path, port: int = 0) -> BuiltinServer:
    """A real built-in server on the tiny model, one thread (`port` 0: a free one)."""
    return start_builtin_server(
        model_dir,
        port=port,
        device="cpu",
        dtype="float32",
        max_model_len=512,
        num_threads=1,
        timeout_s=180,
        log_path=log_path,
    )


@contextlib.contextmanager
def builtin_servers(model_dir: str, log_dir) -> Iterator[list[BuiltinServer]]:
    """Two real built-in servers on the tiny model, one thread each; stopped (or found dead) after."""
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(builtin_server(model_dir, log_dir / f"server-{index}.log"))
            for index in range(2)
        ]
        yield servers
    assert all(server.process.poll() is not None for server in servers), "a server outlived its test"


@pytest.fixture(scope="module")
def shared_servers(tiny_model_dir, tmp_path_factory):
    """Two servers for the tests that leave them running (the weight update's test runs last of those)."""
    with builtin_servers(tiny_model_dir, tmp_path_factory.mktemp("servers")) as servers:
        yield servers


@pytest.fixture
def two_servers(tiny_model_dir, tmp_path):
    """Two servers of the test's own, for the tests that kill them."""
    with builtin_servers(tiny_model_dir, tmp_path) as servers:
        yield servers


class RecordingRouter(GenerationRouter):
    """The router, remembering (route key, URL) of every placement it made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.placements: list[tuple[Any, str]] = []

    def _place(self, route_key):
        server = super()._place(route_key)
        self.placements.append((route_key, server.url))
        return server

    def placed_on(self, url: str) -> int:
        return sum(placed == url for _, placed in self.placements)


class RecordingClient(GenerationClient):
    """The HTTP client, keeping each completion it returned with its prompt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.completions: list[tuple[list[int], Completion]] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig, **kwargs: Any) -> Completion:
        completion = await super().generate(prompt_ids, sampling, **kwargs)
        self.completions.append((list(prompt_ids), completion))
        return completion


def router_at(
    urls: Sequence[str], states: ServerStates | None = None, **client_kwargs: Any
) -> RecordingRouter:
    """Fast retries, so a killed server is given up on in a fraction of a second."""
    settings = dict(
        timeout_s=30, max_concurrency=8, max_retries=2, retry_backoff_s=0.02, retry_backoff_max_s=0.05
    )
    settings.update(client_kwargs)
    return RecordingRouter([RecordingClient(url, **settings) for url in urls], states=states)


def router_over(servers, states: ServerStates | None = None, **client_kwargs: Any) -> RecordingRouter:
    return router_at([server.base_url for server in servers], states, **client_kwargs)


def served(url: str) -> int:
    """Requests the server itself says it finished (vllm:request_success_total)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        samples = parse_prometheus(response.read().decode())
    return round(sum(s.value for s in samples if s.name == "vllm:request_success_total"))


def loop_over(router: GenerationRouter, tmp_path, num_prompts: int, **config: Any) -> RecordingLoop:
    settings = dict(num_generations=4, max_completion_length=6, max_concurrent_rollouts=8, temperature=1.0)
    settings.update(config)
    texts = [f"prompt {index}" for index in range(num_prompts)]
    loop = make_loop(
        None,
        loop_cls=RecordingLoop,
        dataset=prompt_rows(*texts),
        reward_funcs=[random_reward],
        tmp_path=tmp_path,
        **settings,
        **ONE_PASS,
    )
    loop.client = router
    return loop


def groups_by_server(router: RecordingRouter) -> dict[Any, set[str]]:
    servers: dict[Any, set[str]] = {}
    for key, url in router.placements:
        servers.setdefault(key, set()).add(url)
    return servers


async def test_groups_spread_over_both_servers_and_each_stays_on_one(shared_servers, tmp_path):
    urls = [server.base_url for server in shared_servers]
    before = [served(url) for url in urls]
    router = router_over(shared_servers)
    loop = loop_over(router, tmp_path, num_prompts=6)
    with anyio.fail_after(120):
        async with router:
            await loop.run()
    rollouts = all_rollouts(loop)
    assert len(loop.groups) == 6 and not any(rollout.failed for rollout in rollouts)
    num_turns = sum(len(rollout.turns) for rollout in rollouts)
    assert num_turns == 24 == len(router.placements)
    # what each server says it served is what the router sent it: both got a share
    got = [served(url) - count for url, count in zip(urls, before, strict=True)]
    assert got == [router.placed_on(url) for url in urls] and min(got) >= 4
    # every group (its turns carry the group id) went to one server only
    by_group = groups_by_server(router)
    assert len(by_group) == 6 and all(len(servers) == 1 for servers in by_group.values())
    assert metrics(loop)["rollout/vllm_servers_live"] == 2


async def test_a_busy_server_gets_no_new_requests_until_it_drains(shared_servers):
    busy, idle = (server.base_url for server in shared_servers)
    router = router_over(shared_servers)
    long_turn = SamplingConfig(max_tokens=400, temperature=1.0, num_logprobs=0)
    short_turn = SamplingConfig(max_tokens=2, temperature=1.0, num_logprobs=0)
    idle_before = served(idle)
    with anyio.fail_after(120):
        async with router, GenerationClient(busy, timeout_s=60) as direct, anyio.create_task_group() as tasks:
            # Load the first server behind the router's back. Paused, it holds the three requests in its
            # queue until resumed, so the load lasts however slow the machine is (running, they could end
            # before the router's first poll on a loaded machine, and the load would never be seen).
            await direct.pause("keep")
            try:
                for _ in range(3):
                    tasks.start_soon(lambda: direct.generate(PROMPT, long_turn))
                while True:  # the loop's poll: the router learns the load from /metrics
                    await router.server_load()
                    load = router.servers[0].load
                    if load is not None and load.num_running + load.num_waiting >= 3:
                        break
                    await anyio.sleep(0.05)
                for _ in range(4):
                    await router.generate(PROMPT, short_turn)
            finally:
                await direct.resume()
    assert [url for _, url in router.placements] == [idle] * 4
    assert served(idle) - idle_before == 4


def recomputed(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output token) under the model at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i, token].item() for i, token in enumerate(output)]


def perturbed_policy() -> Any:
    """The tiny model the servers start on, every weight moved: what a weight sync then sends them."""
    from harness.testing import build_tiny_qwen3

    policy = build_tiny_qwen3()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for parameter in policy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return policy


async def on_each(urls: Sequence[str], method: str, *args: Any, **kwargs: Any) -> list[Any]:
    """A client method's answer from each server in turn, straight from it (no router)."""
    results = []
    for url in urls:
        async with GenerationClient(url, timeout_s=60) as client:
            results.append(await getattr(client, method)(*args, **kwargs))
    return results


def test_pause_resume_and_a_weight_update_reach_both_servers(shared_servers):
    from harness.weight_sync.strategies import MergedWeightSync
    from harness.weight_sync.transports import FileTransfer

    urls = [server.base_url for server in shared_servers]
    sampling = SamplingConfig(max_tokens=6, temperature=1.0, num_logprobs=0)
    policy = perturbed_policy()  # the servers serve the tiny model until the update below
    with ClientThread(urls, 60) as thread:
        thread.call("pause", "keep")
        assert anyio.run(on_each, urls, "is_paused") == [True, True]
        thread.call("resume")
        assert anyio.run(on_each, urls, "is_paused") == [False, False]
        old = anyio.run(lambda: on_each(urls, "generate", PROMPT, sampling, seed=3))
        with MergedWeightSync(FileTransfer(), thread) as sync:
            sync.sync(policy, 1)
        new = anyio.run(lambda: on_each(urls, "generate", PROMPT, sampling, seed=3))
        assert anyio.run(on_each, urls, "is_paused") == [False, False]  # resumed after the sync
    for before, after in zip(old, new, strict=True):
        # each server now serves the updated policy: its log-probs are the policy's own, not the old ones
        ours = recomputed(policy, PROMPT, after.output_ids)
        assert after.output_log_probs == pytest.approx(ours, abs=1e-4)
        assert before.output_log_probs != pytest.approx(
            recomputed(policy, PROMPT, before.output_ids), abs=1e-2
        )


async def test_a_server_killed_mid_run_has_its_turns_finished_on_the_other(two_servers, tmp_path):
    survivor, victim = two_servers
    router = router_over(two_servers)
    loop = loop_over(router, tmp_path, num_prompts=8, max_completion_length=48)
    survivor_before = served(survivor.base_url)
    in_flight_at_kill: list[int] = []

    async def kill_while_busy() -> None:
        while not (loop.rollout_buffer.qsize() and router.servers[1].in_flight > 0):
            await anyio.sleep(0.005)
        in_flight_at_kill.append(router.servers[1].in_flight)
        victim.process.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(victim.process.wait)

    with anyio.fail_after(180):
        async with router, anyio.create_task_group() as tasks:
            tasks.start_soon(kill_while_busy)
            await loop.run()
    assert in_flight_at_kill and in_flight_at_kill[0] > 0
    rollouts = all_rollouts(loop)
    assert len(loop.groups) == 8 and not any(rollout.failed for rollout in rollouts)  # nothing lost
    num_turns = sum(len(rollout.turns) for rollout in rollouts)
    summary = metrics(loop)
    assert summary["rollout/vllm_server_dropped_count"] == 1
    failovers = summary["rollout/vllm_failover_count"]
    assert failovers >= 1  # the turns in flight on the victim were sent again
    assert [server.live for server in router.servers] == [True, False]
    # every turn was placed once, plus once more per failover; the survivor finished all it was sent
    assert len(router.placements) == num_turns + failovers
    assert served(survivor.base_url) - survivor_before == router.placed_on(survivor.base_url)
    # after the kill, every turn of a group that had been on the victim went to the survivor
    assert router.placements[-1][1] == survivor.base_url


async def test_with_both_servers_killed_the_run_stops_naming_them(two_servers, tmp_path):
    router = router_over(two_servers)
    loop = loop_over(router, tmp_path, num_prompts=50, max_completion_length=24)

    async def kill_both_after_a_group() -> None:
        while not loop.rollout_buffer.qsize():
            await anyio.sleep(0.01)
        for server in two_servers:
            server.process.send_signal(signal.SIGKILL)
        for server in two_servers:
            await anyio.to_thread.run_sync(server.process.wait)

    started = time.monotonic()
    with pytest.raises(BaseExceptionGroup) as raised:
        with anyio.fail_after(120):
            async with router, anyio.create_task_group() as tasks:
                tasks.start_soon(kill_both_after_a_group)
                await loop.run()
    assert time.monotonic() - started < 100
    errors = _leaves(raised.value)
    assert errors and all(isinstance(error, AllServersUnavailableError) for error in errors), errors
    message = str(errors[0])
    assert "every generation server stopped answering" in message
    assert all(server.base_url in message for server in two_servers)
    assert not any(server.live for server in router.servers)


def trainer_sync(urls: Sequence[str], states: ServerStates, policy: Any) -> list[bool]:
    """What the trainer does at a weight sync, from its own ClientThread and router holding `states`: a
    merged sync through the shared-memory file. Which servers its router saw live before."""
    from harness.weight_sync.strategies import MergedWeightSync
    from harness.weight_sync.transports import FileTransfer

    with ClientThread(urls, 60, server_states=states) as thread:
        live = [server.live for server in thread.client.servers]
        with MergedWeightSync(FileTransfer(), thread) as sync:
            sync.sync(policy, 1)
    return live


async def test_a_restarted_server_is_routed_to_again_only_after_a_weight_sync_and_serves_its_policy(
    two_servers, tiny_model_dir, tmp_path
):
    survivor, victim = two_servers
    urls = [server.base_url for server in two_servers]
    states = ServerStates.shared(urls)  # the run's record, as the trainer makes it
    router = router_over(two_servers, states)  # the rollout worker's
    loop = loop_over(router, tmp_path, num_prompts=2000, max_completion_length=16)  # stopped below
    stop = anyio.Event()
    loop.stop_event = types.SimpleNamespace(is_set=stop.is_set)
    policy = perturbed_policy()
    sampling = SamplingConfig(max_tokens=6, temperature=1.0, num_logprobs=0)
    marks: dict[str, Any] = {}

    async def until(condition) -> None:
        while not condition():
            await anyio.sleep(0.01)

    async def kill_restart_and_sync(stack: contextlib.ExitStack) -> None:
        await until(lambda: router.placed_on(victim.base_url) >= 2)
        victim.process.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(victim.process.wait)
        await until(lambda: not router.servers[1].live)  # dropped by the worker's router at a turn
        marks["dropped"] = len(router.placements)
        port = urlparse(victim.base_url).port
        restarted = await anyio.to_thread.run_sync(
            lambda: stack.enter_context(builtin_server(tiny_model_dir, tmp_path / "restarted.log", port))
        )
        assert restarted.base_url == victim.base_url
        marks["restarted"] = len(router.servers[1].client.completions)
        # it answers /health, holding the weights it started on; the run goes on without it
        on_survivor = router.placed_on(survivor.base_url)
        await until(lambda: router.placed_on(survivor.base_url) >= on_survivor + 16)
        assert served(victim.base_url) == 0 and not router.servers[1].live
        (marks["stale"],) = await on_each([victim.base_url], "generate", PROMPT, sampling, seed=3)
        marks["synced"] = len(router.placements)
        on_victim = router.placed_on(victim.base_url)
        # the trainer: its router saw the worker's drop, and its sync takes the server back
        marks["trainer saw"] = await anyio.to_thread.run_sync(trainer_sync, urls, states, policy)
        await until(lambda: router.placed_on(victim.base_url) >= on_victim + 3)
        while await anyio.to_thread.run_sync(served, victim.base_url) < 2:  # the turn above, and one routed
            await anyio.sleep(0.1)
        stop.set()

    with contextlib.ExitStack() as stack:
        with anyio.fail_after(300):
            async with router, anyio.create_task_group() as tasks:
                tasks.start_soon(kill_restart_and_sync, stack)
                await loop.run()
        assert marks["trainer saw"] == [True, False]
        # nothing went to it between the drop and the sync; after the sync it took new turns
        between = router.placements[marks["dropped"] : marks["synced"]]
        assert between and all(url == survivor.base_url for _, url in between)
        after = [url for _, url in router.placements[marks["synced"] :]]
        assert after.count(victim.base_url) >= 3
        assert [server.live for server in router.servers] == [True, True]
        summary = metrics(loop)
        assert summary["rollout/vllm_server_dropped_count"] == 1
        assert summary["rollout/vllm_server_readmitted_count"] == 1
        # every turn the restarted server served the run was sampled from the synced policy
        turns = router.servers[1].client.completions[marks["restarted"] :]
        assert turns
        for prompt_ids, completion in turns:
            ours = recomputed(policy, prompt_ids, completion.output_ids)
            assert completion.output_log_probs == pytest.approx(ours, abs=1e-4)
        # what it serves now is the synced policy, as the survivor does; before the sync it was not
        synced = await on_each(urls, "generate", PROMPT, sampling, seed=3)
    for completion in synced:
        ours = recomputed(policy, PROMPT, completion.output_ids)
        assert completion.output_log_probs == pytest.approx(ours, abs=1e-4)
    stale = marks["stale"]
    assert stale.output_log_probs != pytest.approx(recomputed(policy, PROMPT, stale.output_ids), abs=1e-2)


def route_in_child(urls: list[str], states: ServerStates, commands: Any, answers: Any) -> None:
    """A spawned process's router over the servers, holding `states` (as a rollout worker's does): per
    "route" command four turns, answered with each server's live flag, the turns placed on each so far and
    its metrics."""

    async def main() -> None:
        sampling = SamplingConfig(max_tokens=2, temperature=1.0, num_logprobs=0)
        async with router_at(urls, states) as router:
            while await anyio.to_thread.run_sync(commands.get) == "route":
                for _ in range(4):
                    await router.generate(PROMPT, sampling)
                live = [server.live for server in router.servers]
                answers.put((live, [router.placed_on(url) for url in urls], router.pop_metrics()))

    anyio.run(main)


def test_a_drop_by_the_trainers_router_stops_routing_in_a_spawned_process(two_servers):
    victim = two_servers[1]
    urls = [server.base_url for server in two_servers]
    states = ServerStates.shared(urls)
    context = multiprocessing.get_context("spawn")
    commands, answers = context.Queue(), context.Queue()
    child = context.Process(target=route_in_child, args=(urls, states, commands, answers), daemon=True)
    child.start()
    try:
        commands.put("route")
        live, placed, _ = answers.get(timeout=120)
        assert live == [True, True] and placed == [2, 2]  # idle servers take turns in turn
        with ClientThread(urls, 60, server_states=states) as thread:  # the trainer's
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait()
            thread.call("pause", "keep")  # its router finds the victim gone
            thread.call("resume")
        commands.put("route")
        live, placed, child_metrics = answers.get(timeout=60)
        # the child never sent the victim a turn again: it knew before it tried
        assert live == [True, False] and placed == [6, 2]
        assert child_metrics["rollout/vllm_failover_count"] == 0
        assert child_metrics["rollout/vllm_server_dropped_count"] == 1
        assert child_metrics["rollout/vllm_servers_live"] == 1
        commands.put("stop")
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        commands.close()
        answers.close()
