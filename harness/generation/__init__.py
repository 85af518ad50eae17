"""The client side of generation: how the rollout worker and the trainer talk to generation servers.

    client.py         GenerationClient: vLLM's HTTP protocol (token-id completions with log-probs, control
                      routes, LoRA adapters), retries on transient errors, typed errors
    client_thread.py  ClientThread: a GenerationClient on a thread of its own, for the trainer's sync code
    server_load.py    a server's load from its Prometheus /metrics (what the concurrency cap reads)
    router.py         GenerationRouter: several servers behind one client's interface (placement by load,
                      a group on one server, failover, control calls to every server, re-admission at a
                      weight sync)
    server_states.py  ServerStates: which servers are live, one record for the trainer's router and every
                      rollout worker's (shared memory)

Who talks to it: harness/rollout/ samples through a GenerationRouter (of one GenerationClient per server);
harness/training/ and harness/weight_sync/ drive pause, resume and weight updates through ClientThread,
which holds a router too. The servers are vLLM or harness/server/.
"""

from harness._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ClientThread": "harness.generation.client_thread",
    "Completion": "harness.generation.client",
    "GenerationClient": "harness.generation.client",
    "GenerationError": "harness.generation.client",
    "GenerationRouter": "harness.generation.router",
    "ModelInfo": "harness.generation.client",
    "SamplingConfig": "harness.generation.client",
    "ServerLoad": "harness.generation.server_load",
    "ServerStates": "harness.generation.server_states",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
