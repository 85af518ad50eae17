"""Which weight-sync strategy a run uses: chosen once at start, on rank 0, from the server's /server_info.

    plan = plan_weight_sync(model, client.server_info(), base_url=..., max_staleness=...)   # rank 0
    plan = plan_weight_sync_for_servers(model, client.call("server_infos"), max_staleness=...)  # or all
    sync = build_weight_sync(plan, server=client, is_main=..., world_size=..., ...)         # every rank

Adapter sync (`AdapterWeightSync`) when the policy is a PEFT LoRA model and the server reports LoRA support
(server_info lora_config with max_loras >= max_staleness + 2 and the adapter's rank within max_lora_rank,
one data-parallel engine); else merged weights (`MergedWeightSync`): for the built-in server on this host
through CUDA IPC when the server can see the trainer's GPU (it reports the UUIDs of the GPUs it sees), else
through the shared-memory file; else through a broadcast group. One log line says which and why. With
several servers every one must take the policy the same way (`plan_weight_sync_for_servers`): adapters
or the file reach them all, a broadcast group only one.

Who talks to it: harness/training/generation_side.py plans and builds at start; the strategies are in
strategies.py, the transports they move merged weights with in transports.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.weight_sync.strategies import AdapterWeightSync, MergedWeightSync, WeightSync
from harness.weight_sync.transports import BroadcastTransfer, FileTransfer, IpcTransfer, is_local_url

if TYPE_CHECKING:
    import torch

    from harness.generation.client_thread import ClientThread

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class WeightSyncPlan:
    """What `plan_weight_sync` chose: "adapter", "ipc", "file" or "broadcast", and why (for the log);
    for merged weights, `send_dtype`, the dtype they travel in when the servers' is narrower than the
    policy's (`sent_as`)."""

    kind: str
    reason: str
    adapter_rank: int | None = None
    send_dtype: str | None = None


def check_no_lm_head_adapter(peft_config: Any) -> None:
    """Refuse an adapter that trains lm_head (target_modules or modules_to_save): raise ValueError."""
    targets = getattr(peft_config, "target_modules", None)
    names = [targets] if isinstance(targets, str) else list(targets or [])
    modules = list(getattr(peft_config, "modules_to_save", None) or [])
    if any("lm_head" in str(name) for name in [*names, *modules]):
        raise ValueError(
            "PEFT adapters on lm_head are not supported: the trainer's log-prob head reads the base output "
            "embedding directly (an adapter there would not be trained or synced), and neither vLLM nor "
            "the built-in server serves LoRA on lm_head at run time. Remove lm_head from target_modules "
            "and modules_to_save (target_modules='all-linear' already leaves it out)."
        )


def lora_config_of(model: Any) -> Any | None:
    """The active LoRA config of a PEFT LoRA model; None for any other model."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    active = getattr(model, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else next(iter(configs.values()))
    if config is None or str(getattr(config, "peft_type", "")).split(".")[-1].upper() != "LORA":
        return None
    return config


def lora_rank(config: Any) -> int:
    return max([int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())])


def plan_weight_sync(
    model: Any,
    server_info: dict[str, Any],
    *,
    base_url: str,
    max_staleness: int,
) -> WeightSyncPlan:
    """Choose how the policy reaches the server (see the module docstring) and log it; rank 0 only. A LoRA
    policy that falls back to merged weights is a warning: it names what the server needs instead."""
    plan = sent_as(
        model, [server_info], _plan(model, server_info, base_url=base_url, max_staleness=max_staleness)
    )
    _log(model, plan)
    return plan


def sent_as(model: Any, server_infos: Sequence[dict[str, Any]], plan: WeightSyncPlan) -> WeightSyncPlan:
    """`plan` with the dtype merged weights travel in: the servers' own, when they all report one float
    dtype narrower than some of the policy's weights (a float32 policy, bf16 servers). The server rounds
    what it receives to its dtype on copy anyway, so casting first changes nothing it holds and halves
    what is gathered and sent."""
    import torch

    from harness.weight_sync.peft import served_parameters

    if plan.kind == "adapter":
        return plan
    names = {
        str(((info.get("vllm_config") or {}).get("model_config") or {}).get("dtype")).removeprefix("torch.")
        for info in server_infos
    }
    served = getattr(torch, names.pop(), None) if len(names) == 1 else None
    if not isinstance(served, torch.dtype) or not served.is_floating_point:
        return plan
    wider = any(
        p.dtype.is_floating_point and p.dtype.itemsize > served.itemsize for _, p in served_parameters(model)
    )
    return dataclasses.replace(plan, send_dtype=str(served).removeprefix("torch.")) if wider else plan


def _log(model: Any, plan: WeightSyncPlan) -> None:
    falls_back = lora_config_of(model) is not None and plan.kind != "adapter"
    sent = f"; sent as {plan.send_dtype}, the server's dtype" if plan.send_dtype else ""
    (log.warning if falls_back else log.info)("weight sync: %s (%s%s)", plan.kind, plan.reason, sent)


def plan_weight_sync_for_servers(
    model: Any, servers: Sequence[tuple[str, dict[str, Any]]], *, max_staleness: int
) -> WeightSyncPlan:
    """`plan_weight_sync` over every server of the run, (URL, /server_info) each, and log it; rank 0 only.

    One server: its plan. Several: they must all take the policy the same way. Adapters and the
    shared-memory file reach any number of servers (each loads the adapter directory or reads the file);
    CUDA IPC is chosen for one server only (several built-in servers on this host read the file instead);
    a broadcast group joins one server, so merged sync to several remote or vLLM servers is refused with
    the alternatives (ValueError)."""
    if len(servers) == 1:
        url, info = servers[0]
        return plan_weight_sync(model, info, base_url=url, max_staleness=max_staleness)
    plans = [_plan(model, info, base_url=url, max_staleness=max_staleness) for url, info in servers]
    plans = [
        WeightSyncPlan("file", "several built-in servers on this host read one shared-memory file")
        if plan.kind == "ipc"
        else plan
        for plan in plans
    ]
    urls = [url for url, _ in servers]
    each = "; ".join(f"{url}: {plan.kind} ({plan.reason})" for url, plan in zip(urls, plans, strict=True))
    if len({plan.kind for plan in plans}) > 1:
        raise ValueError(
            f"the generation servers would take the policy in different ways ({each}); start them alike "
            "(all with LoRA support for adapter sync, or all built-in servers on this host)"
        )
    if plans[0].kind == "broadcast":
        raise ValueError(
            f"merged weight sync by broadcast reaches one server, and this run has {len(servers)} ({each}): "
            "train a PEFT LoRA policy and start every server with LoRA support (adapter sync; vLLM: "
            "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), or run built-in servers on this host "
            "(shared-memory file), or use one server"
        )
    plan = WeightSyncPlan(plans[0].kind, f"{len(servers)} servers: {plans[0].reason}", plans[0].adapter_rank)
    plan = sent_as(model, [info for _, info in servers], plan)
    _log(model, plan)
    return plan


def dtype_mismatch(trainer_dtype: Any, server_info: dict[str, Any]) -> str | None:
    """A warning when the server computes in another dtype than the trainer: the log-prob gap between
    them then grows by orders of magnitude (bf16 against float32: ~1e-2 instead of ~1e-5)."""
    served = ((server_info.get("vllm_config") or {}).get("model_config") or {}).get("dtype")
    if not served:
        return None
    served_name = str(served).removeprefix("torch.")
    trained_name = str(trainer_dtype).removeprefix("torch.")
    if served_name == trained_name:
        return None
    return (
        f"the generation server computes in {served_name}, the trainer in {trained_name}: the sampler's "
        "log-probs will differ from the trainer's far more than rounding (see "
        "sampling/sampling_logp_difference/mean); start the server with --dtype "
        f"{trained_name}, or train in {served_name}"
    )


def _plan(model: Any, server_info: dict[str, Any], *, base_url: str, max_staleness: int) -> WeightSyncPlan:
    builtin = str(server_info.get("server", "")).startswith("agent-harness")
    merged = "file" if builtin and is_local_url(base_url) else "broadcast"
    if merged == "file" and _trainer_gpu(model) in (server_info.get("cuda_device_uuids") or []):
        merged = "ipc"  # the server sees the trainer's GPU: it opens the trainer's buffer
    config = lora_config_of(model)
    if config is None:
        return WeightSyncPlan(merged, "the policy is not a PEFT LoRA model")
    rank = lora_rank(config)
    vllm_config = server_info.get("vllm_config") or {}
    lora = vllm_config.get("lora_config")
    data_parallel = int((vllm_config.get("parallel_config") or {}).get("data_parallel_size") or 1)
    needed = max_staleness + 2
    problem = None
    if not lora:
        problem = (
            "the server has no LoRA support (server_info lora_config is null, or no /server_info: vLLM "
            "needs VLLM_SERVER_DEV_MODE=1); for adapter sync start it with --enable-lora "
            f"--max-lora-rank {_lora_rank_flag(rank)} --max-loras {needed} (vLLM: and "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)"
        )
    elif data_parallel > 1:
        problem = f"data-parallel servers (data_parallel_size={data_parallel}) cannot take runtime adapters"
    elif getattr(config, "use_dora", False) or getattr(config, "modules_to_save", None):
        problem = "the adapter uses DoRA or modules_to_save, which runtime adapter loading does not serve"
    elif int(lora.get("max_loras") or 0) < needed:
        problem = (
            f"the server's max_loras={lora.get('max_loras')} is below max_staleness + 2 = {needed}; "
            f"restart it with --max-loras {needed}"
        )
    elif int(lora.get("max_lora_rank") or 0) < rank:
        problem = (
            f"the adapter's rank {rank} is over the server's max_lora_rank={lora.get('max_lora_rank')}; "
            f"restart it with --max-lora-rank {_lora_rank_flag(rank)}"
        )
    if problem is not None:
        return WeightSyncPlan(merged, f"merged sync instead of adapter sync: {problem}")
    return WeightSyncPlan("adapter", f"the server serves LoRA adapters (rank {rank} adapter)", rank)


def _trainer_gpu(model: Any) -> str | None:
    """The UUID of the GPU the model's parameters are on, or None off CUDA."""
    from harness.weight_sync.cuda_ipc import device_uuid

    parameter = next(iter(model.parameters()), None)
    if parameter is None or parameter.device.type != "cuda":
        return None
    return device_uuid(parameter.device.index or 0)


def _lora_rank_flag(rank: int) -> int:
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


def build_weight_sync(
    plan: WeightSyncPlan,
    *,
    server: ClientThread | None,
    is_main: bool,
    world_size: int,
    output_dir: str | Path,
    max_staleness: int,
    device: torch.device | str = "cpu",
    base_url: str = "",
    deltas: bool = False,
) -> WeightSync:
    """The strategy of `plan`, on every process (rank 0 talks to the server through `server`); `deltas`:
    a broadcast to the built-in server sends changed elements alone after the first sync."""
    import torch

    send_dtype = getattr(torch, plan.send_dtype) if plan.send_dtype else None
    if deltas and is_main and plan.kind != "broadcast":
        log.info("weight_sync_deltas: not used, the weights reach the server by %s, not broadcast", plan.kind)
    merged = functools.partial(
        MergedWeightSync, server=server, is_main=is_main, world_size=world_size, send_dtype=send_dtype
    )
    if plan.kind == "adapter":
        return AdapterWeightSync(
            server, output_dir, window=max_staleness + 1, is_main=is_main, world_size=world_size
        )
    if plan.kind == "file":
        return merged(FileTransfer())
    if plan.kind == "ipc":
        return merged(IpcTransfer(device=device))
    if plan.kind == "broadcast":
        transfer = BroadcastTransfer(device=device, deltas=deltas and is_main)
        if is_main:
            assert server is not None  # rank 0 has the client
            try:
                transfer.connect(server, base_url)
            except ImportError as exc:  # no vLLM on the trainer: say why merged sync was chosen at all
                raise ImportError(f"{exc}. Weight sync is merged because {plan.reason}") from exc
        return merged(transfer)
    raise ValueError(f"unknown weight sync kind {plan.kind!r}")


__all__ = [
    "VLLM_LORA_RANKS",
    "WeightSyncPlan",
    "build_weight_sync",
    "check_no_lm_head_adapter",
    "lora_config_of",
    "lora_rank",
    "plan_weight_sync",
    "plan_weight_sync_for_servers",
]
