"""The trainer's blocking handle on the async `GenerationClient`.

The trainer is synchronous; the client is a set of coroutines. `ClientThread` owns an anyio event loop
on a private thread, builds the client there (a `GenerationRouter` over the configured servers, one or
several: each call reaches every server) and runs its coroutines to completion from the calling
thread. Rank 0 of the trainer opens one per run (`harness/training/trainer.py`), its router sharing the
run's `ServerStates` with the rollout workers'; the weight-sync strategies
(`harness/weight_sync/strategies.py`) drive every server call of a sync through it, inside `readmitting()`,
which brings dropped servers that answer again into the sync and back into routing (router.py).

    with ClientThread("http://localhost:8000", timeout_s=1800) as server:   # waits until ready
        with server.readmitting():                    # around each weight sync
            server.call("pause", "keep")              # a client coroutine, by name
            reply = server.start("send_weight_manifest", info)   # started; a concurrent.futures.Future
            server.call("resume")

Closing (leaving `with`) closes the client on its loop, then stops the loop thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.generation.protocol import ServerControl
    from harness.generation.server_states import ServerStates


class ClientThread:
    """A GenerationClient on a private event-loop thread, for the synchronous trainer.

    `base_url`: the server's URL, or several (a list, or separated by commas): see
    `harness.generation.router.server_urls`. `server_states`: the run's record of live servers, shared with
    the rollout workers' routers (`ServerStates.shared`); default: the router's own. `client`: any
    `ServerControl` to drive instead of a router over `base_url` (tests pass
    `harness.testing.FakeGenerationServer`, or a `GenerationRouter` over such doubles); it is used as it is
    and not closed here.
    """

    def __init__(
        self,
        base_url: str | Sequence[str] = "",
        timeout_s: float = 1800.0,
        *,
        server_states: ServerStates | None = None,
        client: ServerControl | None = None,
    ):
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.server_states = server_states
        self.client: Any = client
        self._owns_client = client is None

    def __enter__(self) -> ClientThread:
        from anyio.from_thread import start_blocking_portal

        from harness.generation.router import GenerationRouter

        self._portal_cm = start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        if self._owns_client:
            self.client = self.portal.call(
                lambda: GenerationRouter.from_urls(
                    self.base_url, states=self.server_states, timeout_s=self.timeout_s, max_concurrency=4
                )
            )
        self.portal.call(self.client.wait_until_ready)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._owns_client:
            with contextlib.suppress(Exception):
                self.portal.call(self.client.aclose)
        self._portal_cm.__exit__(None, None, None)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run the client's coroutine method `method` to completion on the loop thread."""
        return self.portal.call(functools.partial(getattr(self.client, method), *args, **kwargs))

    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a coroutine function to completion on the loop thread."""
        return self.portal.call(functools.partial(function, *args, **kwargs))

    @contextlib.contextmanager
    def readmitting(self) -> Iterator[list[str]]:
        """Around one weight sync: the dropped servers that answer /health again join its calls, and are
        routed to again (by every process sharing the server states) once it succeeded; after a failure they
        stay dropped (`GenerationRouter.take_back`). Yields their URLs; [] for a client that is one server
        (`client=` a double), which has none to take back."""
        from harness.generation.router import GenerationRouter

        if not isinstance(self.client, GenerationRouter):
            yield []
            return
        joining = self.call("take_back")
        try:
            yield joining
        except BaseException:
            if joining:
                self.call("leave_out")
            raise
        if joining:
            self.call("readmit")

    def start(self, method: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Start the client's coroutine method `method` on the loop thread; its future."""
        return self.portal.start_task_soon(functools.partial(getattr(self.client, method), *args, **kwargs))

    def max_model_len(self) -> int:
        return self.call("model_info").max_model_len or 4096

    def model_id(self) -> str:
        return self.call("model_info").id

    def server_info(self) -> dict[str, Any]:
        return self.call("server_info")


__all__ = ["ClientThread"]
