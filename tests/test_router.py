"""GenerationRouter at unit level: the URL list, placement by load, a group on one server, failover, control
calls to every server, a drop shared by the routers of a run and a server taken back at a weight sync, and
the weight-sync plan over several servers. The servers are the shared generation double
(harness.testing.FakeGenerationServer), with a load and a way to die and restart added here; the same
behaviour against real built-in servers, and across processes, is in tests/test_router_servers.py."""

from __future__ import annotations

import logging

import anyio
import pytest
import torch

from harness.generation.client_thread import ClientThread
from harness.generation.protocol import (
    AllServersUnavailableError,
    SamplingConfig,
    ServerRequestError,
    ServerUnavailableError,
)
from harness.generation.router import GenerationRouter, placement_score, server_urls
from harness.generation.server_load import ServerLoad
from harness.generation.server_states import ServerStates
from harness.testing import FakeGenerationServer
from harness.weight_sync.plan import plan_weight_sync_for_servers
from harness.weight_sync.strategies import MergedWeightSync
from harness.weight_sync.transports import FileTransfer

pytestmark = pytest.mark.anyio
SAMPLING = SamplingConfig(max_tokens=4, num_logprobs=0)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def load(running: int = 0, waiting: int = 0, usage: float | None = 0.0, **counts: int) -> ServerLoad:
    return ServerLoad(usage, running, waiting, counts.get("preemptions", 0), counts.get("kv_tokens"))


class Server(FakeGenerationServer):
    """The double with a /metrics load of its own, `dead` to make it stop answering (every call then
    raises ServerUnavailableError, as GenerationClient does once its retries are spent), and `restart()`
    to have it answer again holding nothing of the run (no adapter, no update)."""

    def __init__(self, name: str, latency_s: float = 0.0) -> None:
        super().__init__(lambda prompt, call: [7, 2], latency_s=latency_s, model_id=f"model-{name}")
        self.name = name
        self.load: ServerLoad | None = None
        self.dead = False
        self.models: list[str | None] = []
        self.prompts: list[list[int]] = []

        async def unless_dead(*args: object) -> None:
            if self.dead:
                raise ServerUnavailableError(f"{self.name}: connection refused")

        for method in (
            "wait_until_ready",
            "generate",
            "pause",
            "resume",
            "start_weight_update",
            "send_weight_manifest",
            "finish_weight_update",
            "load_lora_adapter",
            "unload_lora_adapter",
        ):
            self.before(method, unless_dead)

    def restart(self) -> None:
        self.dead = False
        self.adapters.clear()
        self.weights.clear()
        self.calls.clear()

    async def generate(self, prompt_ids, sampling, *, model=None, seed=None, route_key=None):
        self.models.append(model)
        self.prompts.append(list(prompt_ids))
        return await super().generate(prompt_ids, sampling, model=model, seed=seed)

    async def server_load(self) -> ServerLoad | None:
        return self.load


def urls_of(*servers: Server) -> list[str]:
    return [f"http://{s.name}:8000" for s in servers]


def router_of(*servers: Server, states: ServerStates | None = None) -> GenerationRouter:
    return GenerationRouter(list(servers), urls=urls_of(*servers), model="model-a", states=states)


def worker_and_trainer(*servers: Server) -> tuple[GenerationRouter, GenerationRouter]:
    """Two routers over the same servers holding one record of which are live, as a rollout worker's and
    the trainer's do (in one process here: tests/test_router_servers.py shares one across processes)."""
    states = ServerStates(urls_of(*servers))
    return router_of(*servers, states=states), router_of(*servers, states=states)


# --- the URL list ---------------------------------------------------------------------------------------


def test_server_urls_accepts_one_a_list_or_commas_and_normalises():
    assert server_urls("http://a:8000/v1/") == ["http://a:8000"]
    assert server_urls(" http://a:8000 , http://b:8000") == ["http://a:8000", "http://b:8000"]
    assert server_urls(["http://a:8000", "https://b"]) == ["http://a:8000", "https://b"]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ([], "is empty: give the URL of at least one"),
        ("", "empty entry"),
        ("http://a:8000,,http://b:8000", "empty entry"),
        ("localhost:8000", "'localhost:8000' is not a server URL; write each as http://host:port"),
        ("http://a:port", "is not a server URL"),
        (["http://a:8000", "http://a:8000/v1"], "lists http://a:8000 twice; give each server once"),
        ([8000], "8000 is not a string"),
    ],
)
def test_server_urls_names_the_problem_and_the_fix(value, problem):
    with pytest.raises(ValueError, match="vllm_server_base_url") as raised:
        server_urls(value)
    assert problem in str(raised.value)


def test_the_config_checks_the_urls():
    from harness.config import AsyncGRPOConfig

    config = AsyncGRPOConfig(output_dir="/tmp/unused", vllm_server_base_url=["http://a:1", "http://b:2"])
    assert config.vllm_server_base_url == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="lists http://a:1 twice"):
        AsyncGRPOConfig(output_dir="/tmp/unused", vllm_server_base_url="http://a:1,http://a:1")


# --- placement -------------------------------------------------------------------------------------------


def test_placement_score_counts_requests_since_the_poll_waiting_twice_and_kv_pressure():
    assert placement_score(None, in_flight=3, in_flight_at_poll=0) == 3
    # 4 running + 2 waiting at the poll, 1 more of ours since: 7 requests, the 2 waiting again, x 1.5
    assert placement_score(load(4, 2, 0.5), in_flight=3, in_flight_at_poll=2) == (7 + 2) * 1.5
    # our requests that finished since the poll take their share off, never below zero
    assert placement_score(load(1, 0, None), in_flight=0, in_flight_at_poll=5) == 0


async def test_requests_go_to_the_least_loaded_server_and_spread_between_polls():
    busy, idle = Server("a"), Server("b")
    busy.load, idle.load = load(running=6, usage=0.7), load(running=1, usage=0.1)
    router = router_of(busy, idle)
    merged = await router.server_load()
    assert merged == ServerLoad(0.7, 7, 0, 0, None)  # the fullest server's KV usage, counts summed
    for _ in range(3):
        await router.generate([1, 2], SAMPLING)
    assert (busy.generate_calls, idle.generate_calls) == (0, 3)
    # between polls the router's own in-flight requests count: concurrent ones spread over both
    busy.latency_s = idle.latency_s = 0.05
    busy.load = idle.load = load()
    await router.server_load()
    async with anyio.create_task_group() as group:
        for _ in range(6):
            group.start_soon(router.generate, [1, 2], SAMPLING)
    assert (busy.generate_calls, idle.generate_calls - 3) == (3, 3)


async def test_a_groups_requests_stay_on_the_server_the_first_went_to():
    a, b = Server("a", latency_s=0.01), Server("b", latency_s=0.01)
    router = router_of(a, b)

    async def group_of_four(group_id: int) -> None:
        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(lambda: router.generate([group_id], SAMPLING, route_key=group_id))

    async with anyio.create_task_group() as groups:
        for group_id in range(6):
            groups.start_soon(group_of_four, group_id)
    # each group (its prompt is its id) went wholly to one server, and both servers got groups
    groups_on = {server.name: [prompt[0] for prompt in server.prompts] for server in (a, b)}
    for group_id in range(6):
        counts = [ids.count(group_id) for ids in groups_on.values()]
        assert sorted(counts) == [0, 4], (group_id, groups_on)
    assert groups_on["a"] and groups_on["b"]


async def test_the_base_model_is_each_servers_own_and_an_adapter_name_is_kept():
    a, b = Server("a"), Server("b")
    router = router_of(a, b)  # model="model-a": what a's /v1/models says; b serves it as "model-b"
    assert (await router.model_info()).id == "model-a"
    for _ in range(2):
        await router.generate([1], SAMPLING)
    await router.generate([1], SAMPLING, model="policy-v3")
    await router.generate([1], SAMPLING, model="policy-v3")
    assert sorted(a.models + b.models, key=str) == [None, None, "policy-v3", "policy-v3"]


# --- failover --------------------------------------------------------------------------------------------


async def test_a_dead_server_is_dropped_its_turn_sent_to_another_and_counted(caplog):
    a, b = Server("a"), Server("b")
    router = router_of(a, b)
    await router.generate([1], SAMPLING, route_key=0)  # group 0 is placed on a
    a.dead = True
    completion = await router.generate([1], SAMPLING, route_key=0)
    assert completion.output_ids == [7, 2] and b.generate_calls == 1
    assert [server.live for server in router.servers] == [False, True]
    assert "http://a:8000 stopped answering and is dropped from routing (1 of 2 left)" in caplog.text
    metrics = router.pop_metrics()
    assert metrics["rollout/vllm_servers_live"] == 1
    assert metrics["rollout/vllm_server_dropped_count"] == 1 and metrics["rollout/vllm_failover_count"] == 1
    assert router.pop_metrics()["rollout/vllm_server_dropped_count"] == 0  # counted once
    await router.pause()  # control calls now reach the live server only
    assert b.paused and not a.paused


async def test_a_failing_server_that_still_answers_health_keeps_its_place():
    a, b = Server("a"), Server("b")

    async def fails(*args: object) -> None:
        raise ServerUnavailableError("500 after every retry")

    a.before("generate", fails)  # /health still answers
    router = router_of(a, b)
    with pytest.raises(ServerUnavailableError, match="500 after every retry"):
        await router.generate([1], SAMPLING)
    assert all(server.live for server in router.servers)


async def test_with_every_server_gone_the_error_names_each_one():
    a, b = Server("a"), Server("b")
    router = router_of(a, b)
    a.dead = b.dead = True
    with pytest.raises(AllServersUnavailableError) as raised:
        await router.generate([1], SAMPLING)
    message = str(raised.value)
    assert "every generation server stopped answering" in message
    assert "http://a:8000: a: connection refused" in message
    assert "http://b:8000: b: connection refused" in message
    assert "resume the run from its last checkpoint" in message
    with pytest.raises(AllServersUnavailableError):
        await router.pause()


# --- one record of live servers, and re-admission at a weight sync ---------------------------------------


def test_server_states_change_only_as_their_caller_saw_them_and_report_each_change_once():
    states = ServerStates(["http://a:8000", "http://b:8000"])
    assert states.transitions() == [0, 0] and states.is_live(0)
    assert states.drop(0, seen=0) and not states.is_live(0)
    assert not states.drop(0, seen=0)  # a second router that saw it live: one drop, not two
    assert not states.readmit(1, seen=0)  # b is live: nothing to take back
    assert states.readmit(0, seen=1) and states.transitions() == [2, 0]
    assert not states.drop(0, seen=0)  # a call sent before it came back does not drop it again
    assert states.pop_counts() == (1, 1)
    assert states.pop_counts() == (0, 0)  # whoever asks next: reported already
    assert states.drop(0, seen=2) and states.pop_counts() == (1, 0)


def test_a_router_refuses_states_kept_for_other_servers():
    with pytest.raises(ValueError, match="build the states and every router from the same URL list"):
        router_of(Server("a"), Server("b"), states=ServerStates(["http://a:8000"]))


async def test_a_drop_by_one_router_stops_routing_in_another_holding_the_same_states():
    a, b = Server("a"), Server("b")
    worker, trainer = worker_and_trainer(a, b)
    a.dead = True
    await trainer.pause()  # the trainer's router finds a gone at a control call
    await trainer.resume()
    assert [server.live for server in worker.servers] == [False, True]
    for _ in range(4):
        await worker.generate([1], SAMPLING)
    assert (a.generate_calls, b.generate_calls) == (0, 4) and worker.num_failovers == 0
    metrics = worker.pop_metrics()
    assert metrics["rollout/vllm_servers_live"] == 1 and metrics["rollout/vllm_server_dropped_count"] == 1
    assert trainer.pop_metrics()["rollout/vllm_server_dropped_count"] == 0  # the run's drop, reported once
    b.dead = True
    with pytest.raises(AllServersUnavailableError) as raised:
        await worker.generate([1], SAMPLING)
    assert "http://a:8000: dropped elsewhere in the run (by the trainer or a rollout worker)" in str(
        raised.value
    )
    assert "http://b:8000: b: connection refused" in str(raised.value)


async def test_a_server_that_answers_again_takes_the_next_sync_and_only_then_is_routed_to(caplog):
    caplog.set_level(logging.INFO, logger="harness.generation.router")
    a, b = Server("a"), Server("b")
    worker, trainer = worker_and_trainer(a, b)
    a.dead = True
    await worker.generate([1], SAMPLING)  # placed on a (idle, first), sent again to b: a is dropped
    a.restart()  # answers /health again, with the weights it was started on
    for _ in range(3):
        await worker.generate([1], SAMPLING)
    assert (a.generate_calls, b.generate_calls) == (1, 4)  # not routed to: it may hold stale weights
    assert await trainer.take_back() == ["http://a:8000"]
    assert not worker.servers[0].live  # in the sync, not yet in routing
    await trainer.pause("keep")
    await worker.generate([1], SAMPLING)
    await trainer.resume()
    assert a.calls == [("/pause", "keep"), ("/resume", None)] and b.calls == a.calls
    assert (a.generate_calls, b.generate_calls) == (1, 5)
    assert trainer.readmit() == ["http://a:8000"]
    assert "http://a:8000 took the weight sync and is routed to again (2 of 2 live)" in caplog.text
    for _ in range(2):
        await worker.generate([1], SAMPLING)
    assert a.generate_calls == 3  # the readmitted server, idle, takes new turns
    metrics = worker.pop_metrics()
    assert metrics["rollout/vllm_servers_live"] == 2
    assert metrics["rollout/vllm_server_dropped_count"] == 1
    assert metrics["rollout/vllm_server_readmitted_count"] == 1
    assert await trainer.take_back() == []  # nothing left to take back


async def test_a_returning_server_is_given_the_adapters_the_live_servers_hold():
    a, b = Server("a"), Server("b")
    trainer = router_of(a, b)
    for version in (1, 2):
        await trainer.load_lora_adapter(f"policy-v{version}", f"/adapters/policy-v{version}")
    a.dead = True
    await trainer.load_lora_adapter("policy-v3", "/adapters/policy-v3")  # a is dropped at this call
    await trainer.unload_lora_adapter("policy-v1")  # out of the window
    a.restart()  # a restarted server holds no adapter
    assert await trainer.take_back() == ["http://a:8000"]
    # what b holds, in the order it was loaded; each unloaded first, in case a still held it
    assert [(route, body["lora_name"]) for route, body in a.calls] == [
        ("/v1/unload_lora_adapter", "policy-v2"),
        ("/v1/load_lora_adapter", "policy-v2"),
        ("/v1/unload_lora_adapter", "policy-v3"),
        ("/v1/load_lora_adapter", "policy-v3"),
    ]
    await trainer.load_lora_adapter("policy-v4", "/adapters/policy-v4")  # the sync: a takes it too
    await trainer.unload_lora_adapter("policy-v2")
    assert trainer.readmit() == ["http://a:8000"]
    assert (
        a.adapters == b.adapters == {"policy-v3": "/adapters/policy-v3", "policy-v4": "/adapters/policy-v4"}
    )


async def test_a_returning_server_that_fails_a_call_of_the_sync_stays_dropped_and_the_sync_goes_on(caplog):
    a, b = Server("a"), Server("b")
    router = router_of(a, b)
    a.dead = True
    await router.pause()
    await router.resume()
    assert await router.take_back() == []  # still not answering
    a.restart()

    async def refuses(*args: object) -> None:
        raise ServerRequestError(400, "weight update refused")

    a.before("start_weight_update", refuses)
    assert await router.take_back() == ["http://a:8000"]
    await router.pause()
    await router.start_weight_update()  # refused by a: not an error of the sync
    await router.finish_weight_update()
    await router.resume()
    assert [route for route, _ in a.calls] == ["/pause", "/start_weight_update"]  # left out of the rest
    assert [route for route, _ in b.calls][-4:] == [
        "/pause",
        "/start_weight_update",
        "/finish_weight_update",
        "/resume",
    ]
    assert router.readmit() == [] and [server.live for server in router.servers] == [False, True]
    assert (
        "http://a:8000, back after a drop, stays dropped: POST /start_weight_update failed "
        "(ServerRequestError: 400: weight update refused)" in caplog.text
    )


def test_a_merged_weight_sync_takes_a_returning_server_back_only_when_it_succeeds(tiny_qwen3, tmp_path):
    a, b = Server("a"), Server("b")
    router = router_of(a, b)

    async def refuses(*args: object) -> None:
        raise ServerRequestError(400, "manifest refused")

    with ClientThread(client=router) as thread:
        a.dead = True
        thread.call("pause")  # the trainer's router drops a
        thread.call("resume")
        a.restart()
        b.before("send_weight_manifest", refuses)  # a live server refuses: the sync fails
        with pytest.raises(ServerRequestError, match="manifest refused"):
            MergedWeightSync(FileTransfer(tmp_path), thread).sync(tiny_qwen3, 1)
        assert [server.live for server in router.servers] == [False, True]  # stays out: it took no sync
        b.before("send_weight_manifest", None)
        MergedWeightSync(FileTransfer(tmp_path), thread).sync(tiny_qwen3, 2)
    assert [server.live for server in router.servers] == [True, True]
    assert [route for route, _ in a.calls][-5:] == [
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/resume",
    ]
    served = dict(tiny_qwen3.named_parameters())
    assert a.weights.keys() == b.weights.keys() and a.weights
    for name, tensor in a.weights.items():  # every weight, as the live server got it
        assert torch.equal(tensor, b.weights[name]) and torch.equal(tensor, served[name].detach())


# --- control calls ---------------------------------------------------------------------------------------


async def test_control_calls_reach_every_server_and_a_refusal_names_the_server():
    a, b = Server("a"), Server("b")
    router = router_of(a, b)
    await router.pause("keep")
    assert a.paused and b.paused
    await router.load_lora_adapter("policy-v1", "/adapters/policy-v1")
    assert a.adapters == b.adapters == {"policy-v1": "/adapters/policy-v1"}
    await router.resume()
    assert not a.paused and not b.paused

    async def refuses(*args: object) -> None:
        raise ServerRequestError(404, "runtime LoRA updating is off")

    b.before("load_lora_adapter", refuses)
    with pytest.raises(ServerRequestError) as raised:
        await router.load_lora_adapter("policy-v2", "/adapters/policy-v2")
    assert raised.value.status == 404  # the type and status callers check survive
    assert "loading an adapter on generation server http://b:8000" in raised.value.__notes__
    assert all(server.live for server in router.servers)  # b answers: refused, not gone


async def test_a_broadcast_group_refuses_several_servers():
    router = router_of(Server("a"), Server("b"))
    with pytest.raises(ValueError, match="for one generation server, and this run has 2"):
        await router.get_world_size()
    assert await router_of(Server("c")).get_world_size() == 1


# --- the weight-sync plan over several servers -----------------------------------------------------------


def builtin(**extra: object) -> dict:
    return {"server": "agent-harness 0.1", **extra}


def test_several_builtin_servers_on_this_host_share_the_file(tiny_qwen3):
    servers = [("http://127.0.0.1:8001", builtin()), ("http://127.0.0.1:8002", builtin())]
    plan = plan_weight_sync_for_servers(tiny_qwen3, servers, max_staleness=1)
    assert plan.kind == "file" and plan.reason.startswith("2 servers:")


def test_merged_sync_to_several_remote_servers_is_refused_with_the_alternatives(tiny_qwen3):
    servers = [("http://10.0.0.1:8000", {}), ("http://10.0.0.2:8000", {})]
    with pytest.raises(ValueError, match="broadcast reaches one server, and this run has 2") as raised:
        plan_weight_sync_for_servers(tiny_qwen3, servers, max_staleness=1)
    assert "adapter sync" in str(raised.value) and "or use one server" in str(raised.value)
    mixed = [("http://127.0.0.1:8001", builtin()), ("http://10.0.0.2:8000", {})]
    with pytest.raises(ValueError, match="would take the policy in different ways") as raised:
        plan_weight_sync_for_servers(tiny_qwen3, mixed, max_staleness=1)
    assert "http://10.0.0.2:8000: broadcast" in str(raised.value)
