"""GenerationRouter: several generation servers behind the interface of one `GenerationClient`.

The rollout worker and the trainer always talk to a router (a single server is a router of one), built from
the config's `vllm_server_base_url`, a URL or a list of them (`server_urls` checks it):

    async with GenerationRouter.from_urls(["http://gpu0:8000", "http://gpu1:8000"], timeout_s=1800) as router:
        await router.wait_until_ready()                        # every server, or ServerUnavailableError
        completion = await router.generate(prompt_ids, sampling, route_key=group_id)
        load = await router.server_load()                      # polls each server, merged (ServerLoad.merged)
        await router.pause("keep")                             # control calls reach every live server

Placement: a request goes to the least loaded live server (`placement_score`): the requests it had at the
last /metrics poll (vllm:num_requests_running + vllm:num_requests_waiting), moved by the requests this router
started and finished there since, waiting requests counted once more, scaled by its KV-cache usage. The
rollout loop's own poll (every few seconds) refreshes the loads; between polls the router's in-flight
counts keep requests from herding onto the server that looked emptiest, and ties go to the server sent
the fewest requests so far. Requests with the same
`route_key` (the loop passes the group id: a GRPO group shares its prompt) stay on the server the first
one went to, so the group's later rollouts hit that server's prefix cache.

Failover: a server is dropped from routing when it stops answering: a call failed with
`ServerUnavailableError` (the client's retries spent) and one look at its /health fails too. A generation
request on a dropped server is sent again to another live server (its group follows it there); a server
that still answers /health keeps its place and the request's error goes to the caller (for the rollout
loop, a failed rollout). Which servers are live is one record for the run (`ServerStates`, server_states.py,
in shared memory) that the trainer's router and every rollout worker's hold: a drop by any of them stops
routing in all. With no server left every call raises `AllServersUnavailableError`, naming each server and
its failure: the rollout loop lets it stop the run.

Re-admission: a dropped server that answers /health again is routed to again only once it holds the current
policy, which only the side that syncs weights can give it. The trainer's router takes it back around each
weight sync (`ClientThread.readmitting`, entered by `WeightSync.sync`):

    joining = await router.take_back()   # dropped servers that answer /health join the sync's calls
    ...                                  # the sync: pause, weight update, resume; or the new adapter
    router.readmit()                     # they took all of it: live again, for every router
    router.leave_out()                   # instead, when the sync failed: they stay dropped

A joining server takes the sync's control calls and no generation. For adapter sync it first gets the
adapters the live servers hold (the router keeps what it loaded and unloaded), so every version a worker
may still name is there; a merged sync sends every weight. One that fails a call is left out of the rest
of the sync and stays dropped until the next (logged): it never fails the sync.

Run start and mid-run: at start every server must answer /health, and the weight sync's start puts each on
the starting policy (adapter sync loads the starting version; merged sync takes each to serve what it was
started on). What a server that comes back mid-run holds is unknown (a restart on some checkpoint, or
stale weights after a partition), so it waits for the next sync, even before the run's first, when its
checkpoint may be the policy: the router cannot tell, and the wait is at most weight_sync_steps steps. With
one server its drop stops the run: nothing is taken back.

Metrics (`pop_metrics()`): `rollout/vllm_servers_live`, `rollout/vllm_server_dropped_count`,
`rollout/vllm_server_readmitted_count` and `rollout/vllm_failover_count`. Drops and re-admissions are the
run's, each reported once, by whichever router pops them first (the workers': the trainer's never pops);
failovers are this router's.

Control calls (pause, resume, the weight-update steps, adapters) go to every live server at once; an
error of one is raised, naming the server (a half-applied sync must surface), except that a server which
no longer answers /health is dropped and the call counts as done on the others (a joining server's error
leaves it out, above). Calls that only make sense for one server (the broadcast group's `get_world_size`,
`init_weight_transfer_engine`) refuse several.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import anyio

from harness.generation.protocol import (
    AllServersUnavailableError,
    Completion,
    GenerationError,
    ModelInfo,
    PauseMode,
    SamplingConfig,
    ServerRequestError,
    ServerUnavailableError,
)
from harness.generation.server_load import ServerLoad
from harness.generation.server_states import ServerStates, is_live

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_ROUTE_KEYS = 65_536  # groups remembered for stickiness (the oldest are forgotten first)
HEALTH_PROBE_S = 5.0  # how long a dropped server's /health may take to count as answering again


def server_urls(value: str | Sequence[str]) -> list[str]:
    """The generation servers' root URLs from `vllm_server_base_url`: one URL, several separated by commas,
    or a list; each normalised (no trailing "/" or "/v1"). ValueError naming the problem and the fix for an
    empty list, an entry that is not an http(s) URL with a host, or a server listed twice."""
    items = value.split(",") if isinstance(value, str) else list(value)
    urls: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(
                f"vllm_server_base_url: {item!r} is not a string; give each server's URL, e.g. "
                '["http://gpu0:8000", "http://gpu1:8000"]'
            )
        url = item.strip().rstrip("/").removesuffix("/v1")
        if not url:
            raise ValueError(
                f"vllm_server_base_url {value!r} has an empty entry; separate the servers' URLs by single "
                "commas"
            )
        parsed = urlparse(url)
        try:
            parsed.port  # noqa: B018 -- raises ValueError for a port that is not a number
            valid = parsed.scheme in ("http", "https") and bool(parsed.hostname)
        except ValueError:
            valid = False
        if not valid:
            raise ValueError(
                f"vllm_server_base_url: {item.strip()!r} is not a server URL; write each as "
                "http://host:port (several: a list, or separated by commas)"
            )
        if url in urls:
            raise ValueError(f"vllm_server_base_url lists {url} twice; give each server once")
        urls.append(url)
    if not urls:
        raise ValueError(
            "vllm_server_base_url is empty: give the URL of at least one generation server, e.g. "
            '"http://localhost:8000"'
        )
    return urls


def placement_score(load: ServerLoad | None, in_flight: int, in_flight_at_poll: int) -> float:
    """How loaded a server is now; lower is better (see the module docstring).

    `load` is its last poll (None: not polled yet, or no /metrics), `in_flight` the router's requests on it
    now and `in_flight_at_poll` those when `load` was read. Without a load only the router's own count is
    known."""
    if load is None:
        return float(in_flight)
    requests_now = max(load.num_running + load.num_waiting + in_flight - in_flight_at_poll, 0)
    return (requests_now + load.num_waiting) * (1.0 + (load.kv_cache_usage or 0.0))


@dataclass(eq=False)
class _Server:
    """One backend and what the router knows of it."""

    url: str
    client: Any  # a GenerationClient, or any SamplingServer and ServerControl
    index: int  # its slot in the ServerStates
    states: ServerStates
    seen: int = 0  # its transitions (server_states.py) when this router last looked
    failure: str = ""  # why this router dropped it
    load: ServerLoad | None = None
    in_flight: int = 0
    in_flight_at_poll: int = 0
    num_requests: int = 0  # generation requests placed here (for logs and tests)

    @property
    def live(self) -> bool:
        """Whether it is routed to now, by any router sharing the states."""
        return self.states.is_live(self.index)


class GenerationRouter:
    """Routes generation over several servers and fans control calls out to them (module docstring).

    Args:
        clients: One client per server (GenerationClient, or anything with its methods).
        urls: The servers' URLs, for messages; default: each client's `root_url`.
        model: The model name requests send when they name none; a name any server serves as its base
            model means each server's own base model (servers may serve one checkpoint under different ids).
        owns_clients: Whether `aclose()` closes the clients.
        states: The run's record of which servers are live, shared with its other routers
            (`ServerStates.shared`, over the same URLs); default: one of this router's own.
    """

    def __init__(
        self,
        clients: Sequence[Any],
        *,
        urls: Sequence[str] | None = None,
        model: str | None = None,
        owns_clients: bool = True,
        states: ServerStates | None = None,
    ) -> None:
        if not clients:
            raise ValueError("a GenerationRouter needs at least one server")
        names = list(urls) if urls is not None else [str(client.root_url) for client in clients]
        if len(names) != len(clients):
            raise ValueError(f"{len(clients)} clients but {len(names)} URLs")
        self.states = states if states is not None else ServerStates(names)
        if self.states.urls != tuple(names):
            raise ValueError(
                f"the shared server states are of {', '.join(self.states.urls)} and this router's servers "
                f"are {', '.join(names)}: build the states and every router from the same URL list"
            )
        self.servers = [
            _Server(url, client, index, self.states, seen=seen)
            for index, (url, client, seen) in enumerate(
                zip(names, clients, self.states.transitions(), strict=True)
            )
        ]
        self.model = model
        self.owns_clients = owns_clients
        self._routes: collections.OrderedDict[Hashable, _Server] = collections.OrderedDict()
        self._served_ids: set[str] = set()
        self._joining: dict[_Server, int] = {}  # taken back for the weight sync under way: its transitions
        self._adapters: dict[str, str] = {}  # the adapters loaded through this router: name -> path
        self.num_failovers = 0
        self._num_failovers_reported = 0

    @classmethod
    def from_urls(
        cls,
        base_url: str | Sequence[str],
        *,
        model: str | None = None,
        states: ServerStates | None = None,
        **client_kwargs: Any,
    ) -> GenerationRouter:
        """A router over a `GenerationClient(url, **client_kwargs)` per server of `base_url` (a URL, several
        separated by commas, or a list: `server_urls`), sharing `states` when given."""
        from harness.generation.client import GenerationClient

        urls = server_urls(base_url)
        clients = [GenerationClient(url, **client_kwargs) for url in urls]
        return cls(clients, urls=urls, model=model, states=states)

    async def __aenter__(self) -> GenerationRouter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every server's client (when the router owns them; idempotent)."""
        if self.owns_clients:
            for server in self.servers:
                await server.client.aclose()

    # ------------------------------------------------------------------ the servers

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def live_servers(self) -> list[_Server]:
        """The servers routed to now (by the shared states). One taken back since this router last looked
        starts afresh: its load from before the drop says nothing of it now."""
        live = []
        for server, transitions in zip(self.servers, self.states.transitions(), strict=True):
            if transitions != server.seen:
                server.seen = transitions
                if is_live(transitions):
                    server.failure, server.load, server.in_flight_at_poll = "", None, server.in_flight
            if is_live(transitions):
                live.append(server)
        return live

    def _none_left(self) -> AllServersUnavailableError:
        elsewhere = "dropped elsewhere in the run (by the trainer or a rollout worker)"
        failures = "; ".join(f"{server.url}: {server.failure or elsewhere}" for server in self.servers)
        return AllServersUnavailableError(
            f"every generation server stopped answering, so the run cannot go on ({failures}); restart "
            "them (or fix the URLs in vllm_server_base_url) and resume the run from its last checkpoint"
        )

    def _live_or_raise(self) -> list[_Server]:
        live = self.live_servers()
        if not live:
            raise self._none_left()
        return live

    async def _drop_if_gone(self, server: _Server, error: Exception, seen: int) -> bool:
        """Drop `server` from routing, for every router sharing the states, when it does not answer /health
        either; whether it is gone: dropped now, or by anyone since `seen` (its transitions when the failed
        call went out). Raises AllServersUnavailableError when none is left."""
        if self.states.transitions()[server.index] == seen:
            try:
                await server.client.wait_until_ready(timeout_s=0)
            except ServerUnavailableError:
                pass
            else:
                return False
            if self.states.drop(server.index, seen):
                server.failure = str(error)
                log.error(
                    "generation server %s stopped answering and is dropped from routing (%d of %d left): %s",
                    server.url,
                    len(self.live_servers()),
                    len(self.servers),
                    error,
                )
        if not self.live_servers():
            raise self._none_left() from error
        return True

    async def _each(
        self, servers: Sequence[_Server], call: Callable[[Any], Awaitable[T]]
    ) -> list[T | Exception]:
        """`call(client)` on each server at once; its result or its exception, in order."""
        results: list[T | Exception] = [None] * len(servers)  # type: ignore[list-item]

        async def one(index: int, server: _Server) -> None:
            try:
                results[index] = await call(server.client)
            except Exception as exc:  # collected: the caller decides per server
                results[index] = exc

        async with anyio.create_task_group() as tasks:
            for index, server in enumerate(servers):
                tasks.start_soon(one, index, server)
        return results

    async def _fan_out(self, what: str, call: Callable[[Any], Awaitable[T]]) -> list[tuple[_Server, T]]:
        """`call(client)` on every live server at once, and on those joining a weight sync (`take_back`);
        (server, result) of each that did it. A live server that fails and no longer answers /health is
        dropped; any other failure of one is raised, with a note naming the server. A joining server that
        fails is left out of the sync instead."""
        live = self._live_or_raise()
        seen = {server: server.seen for server in live}
        servers = live + [server for server in self._joining if server not in live]
        results = await self._each(servers, call)
        done: list[tuple[_Server, T]] = []
        for server, result in zip(servers, results, strict=True):
            if not isinstance(result, Exception):
                done.append((server, result))
            elif server in self._joining:
                self._leave_out(server, f"{what} failed ({type(result).__name__}: {result})")
            elif isinstance(result, ServerUnavailableError) and await self._drop_if_gone(
                server, result, seen[server]
            ):
                continue
            else:
                result.add_note(f"{what} on generation server {server.url}")
                raise result
        return done

    # ------------------------------------------------------------------ readiness and model

    async def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every server answers /health; ServerUnavailableError naming the first that does not."""
        servers = self.live_servers()
        results = await self._each(servers, lambda client: client.wait_until_ready(timeout_s))
        for server, result in zip(servers, results, strict=True):
            if isinstance(result, Exception):
                result.add_note(f"generation server {server.url} (of {', '.join(self.urls)})")
                raise result

    async def model_info(self, refresh: bool = False) -> ModelInfo:
        """The first live server's model id and the smallest max_model_len of the live servers (a request
        must fit wherever it goes)."""
        infos = [info for _, info in await self._fan_out("GET /v1/models", lambda c: c.model_info(refresh))]
        self._served_ids |= {info.id for info in infos}
        lengths = [info.max_model_len for info in infos if info.max_model_len is not None]
        return ModelInfo(id=infos[0].id, max_model_len=min(lengths) if lengths else None)

    async def _backend_model(self, model: str | None) -> str | None:
        """The name to send a server: None (its own base model) for the base model, else `model`."""
        model = model or self.model
        if model is None:
            return None
        if not self._served_ids:
            await self.model_info()
        return None if model in self._served_ids else model

    # ------------------------------------------------------------------ generation

    def _place(self, route_key: Hashable | None) -> _Server:
        live = self._live_or_raise()
        if route_key is not None:
            server = self._routes.get(route_key)
            if server is not None and server in live:
                self._routes.move_to_end(route_key)
                return server
        # ties (idle servers) go to the one that was sent the fewest requests, so one-at-a-time traffic
        # alternates instead of always taking the first
        server = min(
            live, key=lambda s: (placement_score(s.load, s.in_flight, s.in_flight_at_poll), s.num_requests)
        )
        if route_key is not None:
            self._routes[route_key] = server
            self._routes.move_to_end(route_key)
            while len(self._routes) > MAX_ROUTE_KEYS:
                self._routes.popitem(last=False)
        return server

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        *,
        model: str | None = None,
        seed: int | None = None,
        route_key: Hashable | None = None,
    ) -> Completion:
        """One turn on the least loaded live server, or the one its `route_key` went to; sent again to
        another server when that one stops answering (see the module docstring)."""
        backend_model = await self._backend_model(model)
        while True:
            server = self._place(route_key)
            seen = server.seen  # as _place just read it
            server.in_flight += 1
            server.num_requests += 1
            try:
                return await server.client.generate(prompt_ids, sampling, model=backend_model, seed=seed)
            except ServerUnavailableError as exc:
                if isinstance(exc, AllServersUnavailableError) or not await self._drop_if_gone(
                    server, exc, seen
                ):
                    raise
                self.num_failovers += 1
                log.warning("a turn on %s is sent to another generation server", server.url)
            finally:
                server.in_flight -= 1

    async def describe_candidate_sets(self, sampling: SamplingConfig) -> tuple[str, bool]:
        """Each server's answer (SamplingServer.describe_candidate_sets): one sentence when they agree, else
        one per server; biased when any server's is."""
        answers = await self._fan_out(
            "checking candidate sets", lambda client: client.describe_candidate_sets(sampling)
        )
        messages = list(dict.fromkeys(message for _, (message, _) in answers))
        if len(messages) == 1:
            message = messages[0]
        else:
            message = "; ".join(f"{server.url}: {message}" for server, (message, _) in answers)
        return message, any(biased for _, (_, biased) in answers)

    # ------------------------------------------------------------------ load and metrics

    async def server_load(self) -> ServerLoad | None:
        """Poll every live server's /metrics (what placement reads until the next poll); their loads merged
        (`ServerLoad.merged`), None when no server publishes one. A server whose poll fails keeps its
        previous load (a dead one is dropped by the requests that fail on it); if every poll fails, the
        first error is raised."""
        servers = self._live_or_raise()
        results = await self._each(servers, lambda client: client.server_load())
        loads: list[ServerLoad] = []
        for server, result in zip(servers, results, strict=True):
            if isinstance(result, Exception):
                continue
            server.load, server.in_flight_at_poll = result, server.in_flight
            if result is not None:
                loads.append(result)
        errors = [result for result in results if isinstance(result, Exception)]
        if errors and len(errors) == len(results):
            raise errors[0]
        return ServerLoad.merged(loads) if loads else None

    def pop_metrics(self) -> dict[str, float]:
        """The servers' counters since the previous call, summed (rollout/vllm_retry_count, ...), and the
        router's: rollout/vllm_servers_live (servers routed to), rollout/vllm_server_dropped_count and
        rollout/vllm_server_readmitted_count (the run's drops and re-admissions not yet reported by any
        router sharing the states) and rollout/vllm_failover_count (this router's turns sent again to
        another server)."""
        metrics: dict[str, float] = {}
        for server in self.servers:
            for name, value in server.client.pop_metrics().items():
                metrics[name] = metrics.get(name, 0.0) + value
        dropped, readmitted = self.states.pop_counts()
        metrics["rollout/vllm_servers_live"] = float(len(self.live_servers()))
        metrics["rollout/vllm_server_dropped_count"] = float(dropped)
        metrics["rollout/vllm_server_readmitted_count"] = float(readmitted)
        metrics["rollout/vllm_failover_count"] = float(self.num_failovers - self._num_failovers_reported)
        self._num_failovers_reported = self.num_failovers
        return metrics

    # ------------------------------------------------------------------ re-admission: the syncing side

    async def take_back(self) -> list[str]:
        """As a weight sync starts: each dropped server that answers /health again joins this router's
        control calls (not its routing) until `readmit` or `leave_out`, after the adapters the live servers
        hold are loaded onto it; their URLs (see the module docstring)."""
        live = self.live_servers()
        dropped = [server for server in self.servers if server not in live and server not in self._joining]

        async def answers(client: Any) -> None:
            with anyio.fail_after(HEALTH_PROBE_S):
                await client.wait_until_ready(timeout_s=0)

        results = await self._each(dropped, answers)
        for server, result in zip(dropped, results, strict=True):
            if isinstance(result, ServerUnavailableError | TimeoutError):
                continue  # still gone
            if isinstance(result, Exception):
                raise result
            try:
                await self._load_adapters_onto(server)
            except GenerationError as exc:
                log.warning(
                    "generation server %s answers again but could not load the current adapters (%s), so it "
                    "stays dropped and is tried again at the next weight sync; restart it to clear what "
                    "it still holds",
                    server.url,
                    exc,
                )
                continue
            self._joining[server] = server.seen
            log.info(
                "generation server %s answers again: it takes this weight sync, then is routed to again",
                server.url,
            )
        return [server.url for server in self._joining]

    async def _load_adapters_onto(self, server: _Server) -> None:
        """The adapters loaded through this router, in their order, onto `server`; each unloaded first (a
        server that was unreachable without restarting may still hold it, and a name loads only once)."""
        for name, path in self._adapters.items():
            with contextlib.suppress(ServerRequestError):  # not loaded there: what a restarted server says
                await server.client.unload_lora_adapter(name)
            await server.client.load_lora_adapter(name, path)

    def readmit(self) -> list[str]:
        """After a weight sync that succeeded: the servers that joined it and took every call are live
        again, for every router sharing the states; their URLs."""
        readmitted = [
            server for server, seen in self._joining.items() if self.states.readmit(server.index, seen)
        ]
        self._joining.clear()
        for server in readmitted:
            log.info(
                "generation server %s took the weight sync and is routed to again (%d of %d live)",
                server.url,
                len(self.live_servers()),
                len(self.servers),
            )
        return [server.url for server in readmitted]

    def leave_out(self) -> None:
        """After a weight sync that failed: the servers that joined it stay dropped (until the next one)."""
        for server in list(self._joining):
            self._leave_out(server, "the weight sync failed")

    def _leave_out(self, server: _Server, why: str) -> None:
        del self._joining[server]
        log.warning(
            "generation server %s, back after a drop, stays dropped: %s; it is tried again at the next "
            "weight sync",
            server.url,
            why,
        )

    # ------------------------------------------------------------------ control: every live server

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._fan_out("POST /pause", lambda client: client.pause(mode))

    async def resume(self) -> None:
        await self._fan_out("POST /resume", lambda client: client.resume())

    async def is_paused(self) -> bool:
        """Whether every live server is paused."""
        return all(paused for _, paused in await self._fan_out("GET /is_paused", lambda c: c.is_paused()))

    async def start_weight_update(self) -> None:
        await self._fan_out("POST /start_weight_update", lambda client: client.start_weight_update())

    async def send_weight_manifest(self, update_info: dict[str, Any]) -> None:
        await self._fan_out("POST /update_weights", lambda client: client.send_weight_manifest(update_info))

    async def finish_weight_update(self) -> None:
        await self._fan_out("POST /finish_weight_update", lambda client: client.finish_weight_update())

    async def load_lora_adapter(self, name: str, path: str | Path) -> None:
        await self._fan_out("loading an adapter", lambda client: client.load_lora_adapter(name, path))
        self._adapters[name] = str(path)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._fan_out("unloading an adapter", lambda client: client.unload_lora_adapter(name))
        self._adapters.pop(name, None)

    async def server_info(self) -> dict[str, Any]:
        """The first live server's /server_info (`server_infos` has every server's)."""
        return (await self.server_infos())[0][1]

    async def server_infos(self) -> list[tuple[str, dict[str, Any]]]:
        """(URL, /server_info) of every live server, what the weight-sync plan is chosen from."""
        infos = await self._fan_out("GET /server_info", lambda client: client.server_info())
        return [(server.url, info) for server, info in infos]

    def _only(self, what: str) -> Any:
        live = self._live_or_raise()
        if len(live) > 1:
            raise ValueError(
                f"{what} is for one generation server, and this run has {len(live)} "
                f"({', '.join(server.url for server in live)})"
            )
        return live[0].client

    async def server_version(self) -> str | None:
        """The first live server's version (/version)."""
        return await self._live_or_raise()[0].client.server_version()

    async def get_world_size(self) -> int:
        return await self._only("a weight broadcast group (get_world_size)").get_world_size()

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        client = self._only("a weight broadcast group (init_weight_transfer_engine)")
        await client.init_weight_transfer_engine(init_info)


__all__ = ["GenerationRouter", "placement_score", "server_urls"]
