"""Weight sync (harness/weight_sync/) against the real built-in server on CPU, with a tiny Qwen3.

The server is an EmbeddedServer (real HTTP, in this process), so a test can read the served model's
weights and the loaded adapters directly. The trainer side is the same tiny model (seed 0), wrapped in
LoRA with random B matrices so an adapter changes what the model computes.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import types
from typing import Any

import pytest
import torch

from harness.generation.client_thread import ClientThread
from harness.generation.protocol import SamplingConfig
from harness.server.app import EmbeddedServer
from harness.server.state import ServerConfig, ServerState
from harness.testing import build_tiny_qwen3, build_tiny_tokenizer
from harness.weight_sync.plan import WeightSyncPlan, build_weight_sync, plan_weight_sync
from harness.weight_sync.strategies import LORA_DIR, AdapterWeightSync, MergedWeightSync, adapter_name
from harness.weight_sync.transports import BroadcastTransfer, merged_manifest

peft = pytest.importorskip("peft")

PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingConfig(max_tokens=6, temperature=0.0, num_logprobs=0)


def run_config(tmp_path, **overrides):
    """A 2-step trainer run on the tiny model, one version of staleness (adapters in the window: 2)."""
    from harness.config import AsyncGRPOConfig

    settings = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        max_staleness=1,
        num_generations=4,
        max_completion_length=8,
        max_concurrent_rollouts=8,
        gradient_checkpointing=False,
        token_budget=512,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    return AsyncGRPOConfig(**{**settings, **overrides})


def embedded_server(**config: Any) -> EmbeddedServer:
    settings: dict[str, Any] = dict(model="tiny-qwen3", max_model_len=128, max_num_seqs=16)
    settings.update(config)
    state = ServerState.from_model(
        build_tiny_qwen3(), ServerConfig(**settings), tokenizer=build_tiny_tokenizer()
    )
    return EmbeddedServer(state)


def lora_model(seed: int = 0, r: int = 4, **lora: Any) -> Any:
    lora.setdefault("target_modules", ["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(build_tiny_qwen3(), peft.LoraConfig(r=r, lora_alpha=2 * r, **lora))
    randomize_lora(model, seed)
    return model


def randomize_lora(model: Any, seed: int) -> None:
    """PEFT starts B at zero (a no-op adapter): random B, so every version computes something else."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)


def served_weights_equal(server: EmbeddedServer, model: Any) -> None:
    """Every tensor the sync sends equals the served model's parameter of that name."""
    from harness.weight_sync.peft import merged_named_parameters

    served = dict(server.state.model.named_parameters(remove_duplicate=False))
    count = 0
    for name, tensor in merged_named_parameters(model):
        assert torch.equal(served[name], tensor.to(served[name].dtype)), name
        count += 1
    assert count == len(merged_manifest(model).names) > 0


def greedy(client: ClientThread, model_name: str | None = None) -> Any:
    return client.call("generate", PROMPT, GREEDY, model=model_name)


def forward_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def assert_generated_by(model: Any, completion: Any) -> None:
    """Greedy tokens and log-probs equal a direct forward of `model`."""
    expected = forward_logprobs(model, PROMPT + completion.output_ids)
    for j, token in enumerate(completion.output_ids):
        position = len(PROMPT) - 1 + j
        assert token == int(expected[position].argmax())
        assert completion.output_log_probs[j] == pytest.approx(expected[position, token].item(), abs=1e-4)


# --- the choice (no server) ---------------------------------------------------------------------------------


def builtin_info(
    lora_config: dict[str, int] | None = None, data_parallel: int = 1, device: str = "cpu"
) -> dict[str, Any]:
    return {
        "server": "agent-harness built-in",
        "vllm_config": {
            "lora_config": lora_config,
            "parallel_config": {"data_parallel_size": data_parallel},
            "device_config": {"device": device},
        },
    }


def vllm_info(lora_config: dict[str, int] | None = None) -> dict[str, Any]:
    return {"vllm_config": {"lora_config": lora_config, "weight_transfer_config": {"backend": "nccl"}}}


LOCAL = "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    ("lora", "info", "url", "kind", "reason"),
    [
        (False, builtin_info(), LOCAL, "file", "not a PEFT LoRA model"),
        (False, builtin_info(device="cuda:0"), LOCAL, "file", "not a PEFT LoRA model"),  # trainer on CPU
        (False, builtin_info(), "http://10.255.0.7:8000", "broadcast", "not a PEFT LoRA model"),
        (False, vllm_info(), LOCAL, "broadcast", "not a PEFT LoRA model"),
        (True, vllm_info({"max_loras": 3, "max_lora_rank": 8}), LOCAL, "adapter", "rank 4"),
        (True, builtin_info({"max_loras": 3, "max_lora_rank": 8}), LOCAL, "adapter", "rank 4"),
        (True, vllm_info(None), LOCAL, "broadcast", "no LoRA support"),
        (True, vllm_info({"max_loras": 2, "max_lora_rank": 8}), LOCAL, "broadcast", "--max-loras 3"),
        (True, vllm_info({"max_loras": 3, "max_lora_rank": 1}), LOCAL, "broadcast", "--max-lora-rank 8"),
        (True, builtin_info({"max_loras": 3, "max_lora_rank": 8}, 2), LOCAL, "file", "data-parallel"),
    ],
)
def test_plan_chooses_adapter_only_when_the_server_can_serve_the_window(lora, info, url, kind, reason):
    model = lora_model() if lora else build_tiny_qwen3()
    plan = plan_weight_sync(model, info, base_url=url, max_staleness=1)
    assert plan.kind == kind
    assert reason in plan.reason


def test_an_adapter_on_lm_head_is_refused_at_start():
    from datasets import Dataset

    from harness import AsyncGRPOTrainer
    from harness.config import AsyncGRPOConfig

    args = AsyncGRPOConfig(output_dir="unused", report_to="none", gradient_checkpointing=False)
    dataset = Dataset.from_dict({"prompt": ["hi"]})
    common = dict(reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args)
    for config in (
        peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
        peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    ):
        with pytest.raises(ValueError, match=r"lm_head.*Remove lm_head from target_modules"):
            AsyncGRPOTrainer(
                build_tiny_qwen3(),
                train_dataset=dataset,
                processing_class=build_tiny_tokenizer(),
                peft_config=config,
                **common,
            )
    # also a model the user wrapped before handing it over
    wrapped = peft.get_peft_model(build_tiny_qwen3(), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="log-prob head reads the base output embedding"):
        AsyncGRPOTrainer(wrapped, train_dataset=dataset, processing_class=build_tiny_tokenizer(), **common)


@pytest.fixture(params=["0.32.0"])
def fake_vllm_server(request):
    """A fake vLLM server (its /server_info and /version; the version by indirect parametrisation), behind
    the ClientThread the weight sync drives; it records the bodies a vLLM server would get."""
    from harness.testing import FakeGenerationServer

    fake = FakeGenerationServer(server_info=vllm_info(), version=request.param)
    with ClientThread(LOCAL, 30.0, client=fake) as server:
        yield server


def test_merged_sync_to_vllm_without_vllm_installed_names_the_fix(fake_vllm_server):
    pytest.importorskip("harness.weight_sync.vllm_nccl")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed")
    with pytest.raises(ImportError, match="needs vLLM on the trainer too"):
        BroadcastTransfer().connect(fake_vllm_server, LOCAL)
    assert fake_vllm_server.client.calls == []  # refused before touching the server


@pytest.mark.parametrize(
    ("fake_vllm_server", "packed_in_init"),
    [("0.26.0", False), ("0.32.0", True)],
    indirect=["fake_vllm_server"],
)
def test_merged_sync_to_vllm_speaks_its_protocol_through_the_vllm_nccl_group(
    fake_vllm_server, packed_in_init
):
    """vLLM's classes faked (harness.weight_sync.vllm_nccl takes them), on CPU: the bodies carry only the
    keys of the server's version (the packed format's fields in init_info from 0.28, in each update before),
    and the broadcast bytes are the merged weights in manifest order, bucket by bucket."""
    vllm_nccl = pytest.importorskip("harness.weight_sync.vllm_nccl")
    broadcasts: list[torch.Tensor] = []

    class Communicator:
        def __init__(self, group: Any, device: Any) -> None:
            self.disabled = False

        def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
            assert src == 0
            broadcasts.append(tensor.clone())

    api = vllm_nccl.VllmNcclApi(
        stateless_process_group=types.SimpleNamespace(create=lambda **kwargs: object()),
        communicator=Communicator,
    )
    model = lora_model(seed=6)
    transfer = BroadcastTransfer(device="cpu", buffer_size_bytes=20_000, vllm_api=api)
    transfer.connect(fake_vllm_server, LOCAL)
    calls = fake_vllm_server.client.calls
    assert [path for path, _ in calls] == ["/init_weight_transfer_engine"]
    packing = {"packed", "packed_buffer_size_bytes"}
    base_init = {"master_address", "master_port", "rank_offset", "world_size"}
    assert set(calls[0][1]["init_info"]) == (base_init | packing if packed_in_init else base_init)
    assert calls[0][1]["init_info"]["world_size"] == 2
    calls.clear()
    sync = MergedWeightSync(transfer, fake_vllm_server)
    sync.sync(model, 1)
    assert [path for path, _ in calls] == [
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/resume",
    ]
    assert calls[0][1] == "keep"
    info = calls[2][1]
    assert set(info) == ({"names", "dtype_names", "shapes"} | (set() if packed_in_init else packing))
    from harness.weight_sync.peft import merged_named_parameters

    merged = list(merged_named_parameters(model))
    expected = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in merged])
    assert len(broadcasts) > 1  # several buckets
    assert torch.equal(torch.cat(broadcasts), expected)
    assert info["names"] == [name for name, _ in merged]
    sync.close()


def test_the_worker_names_the_newest_adapter_and_a_rollout_keeps_the_one_it_started_with():
    import anyio

    from harness.rollout.loop import _ROLLOUT_ADAPTER, AsyncRolloutLoop

    version = types.SimpleNamespace(value=3)
    loop = types.SimpleNamespace(lora_name_prefix="policy-x", model_version_value=version, lora_name=None)
    assert AsyncRolloutLoop.served_model(loop) == "policy-x-v3"  # type: ignore[arg-type]
    merged = types.SimpleNamespace(lora_name_prefix=None, model_version_value=version, lora_name="fixed")
    assert AsyncRolloutLoop.served_model(merged) == "fixed"  # type: ignore[arg-type]

    async def rollout() -> tuple[str, str]:
        _ROLLOUT_ADAPTER.set(adapter_name("policy-x", version.value))  # as _run_rollout does
        first = AsyncRolloutLoop.served_model(loop)  # type: ignore[arg-type]
        version.value = 4  # the trainer synced mid-rollout
        return first, AsyncRolloutLoop.served_model(loop)  # type: ignore[arg-type]

    assert anyio.run(rollout) == ("policy-x-v3", "policy-x-v3")
    assert AsyncRolloutLoop.served_model(loop) == "policy-x-v4"  # type: ignore[arg-type]


# --- against the built-in server ----------------------------------------------------------------------------


@pytest.mark.slow
def test_adapter_sync_loads_versions_keeps_the_window_and_deletes_one_sync_later(tmp_path):
    with (
        embedded_server(enable_lora=True, max_loras=3, max_lora_rank=8) as server,
        ClientThread(server.base_url, 60) as client,
    ):
        model = lora_model(seed=0)
        plan = plan_weight_sync(model, client.server_info(), base_url=server.base_url, max_staleness=1)
        assert plan.kind == "adapter"
        sync = build_weight_sync(
            plan, server=client, is_main=True, world_size=1, output_dir=tmp_path, max_staleness=1
        )
        assert isinstance(sync, AdapterWeightSync)
        root = tmp_path / LORA_DIR

        def name(version: int) -> str:
            return adapter_name(sync.adapter_prefix, version)

        def loaded() -> set[str]:
            return set(server.state.lora.adapters)

        sync.start(model, 0)
        assert loaded() == {name(0)}
        assert (root / name(0) / "adapter_config.json").is_file()
        base = greedy(client)
        v0 = greedy(client, name(0))
        assert_generated_by(model, v0)
        assert v0.output_log_probs != base.output_log_probs

        randomize_lora(model, seed=1)
        metrics = sync.sync(model, 1)
        assert {"perf/weight_sync_s", "perf/weight_sync_transfer_s"} <= set(metrics)
        assert all(math.isfinite(v) and v >= 0 for v in metrics.values())
        assert loaded() == {name(0), name(1)}  # max_staleness + 1 versions
        v1 = greedy(client, name(1))
        assert_generated_by(model, v1)
        assert v1.output_log_probs != v0.output_log_probs

        randomize_lora(model, seed=2)
        sync.sync(model, 2)
        assert loaded() == {name(1), name(2)}  # v0 unloaded as it fell out of the window...
        assert (root / name(0)).is_dir()  # ...but its files stay one more sync (vLLM reads lazily)
        sync.sync(model, 3)
        assert loaded() == {name(2), name(3)}
        assert not (root / name(0)).exists() and (root / name(1)).is_dir()
        assert sorted(p.name for p in root.iterdir()) == [name(1), name(2), name(3)]  # no temp dirs left
        assert not client.call("is_paused")

        sync.close()
        assert loaded() == set()
        assert list(root.iterdir()) == []


@pytest.mark.slow
def test_without_lora_support_the_adapter_is_merged_through_the_file_with_the_reason_logged(tmp_path, caplog):
    with embedded_server(enable_lora=False) as server, ClientThread(server.base_url, 60) as client:
        model = lora_model(seed=3)
        with caplog.at_level(logging.INFO, logger="harness.weight_sync"):
            plan = plan_weight_sync(model, client.server_info(), base_url=server.base_url, max_staleness=1)
        assert plan.kind == "file"
        assert "no LoRA support" in caplog.text and "--enable-lora" in caplog.text
        sync = build_weight_sync(
            plan, server=client, is_main=True, world_size=1, output_dir=tmp_path, max_staleness=1
        )
        assert isinstance(sync, MergedWeightSync) and sync.adapter_prefix is None
        metrics = sync.sync(model, 1)
        assert {"perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_transfer_s"} <= set(
            metrics
        )
        served_weights_equal(server, model)
        assert_generated_by(model, greedy(client))
        assert not client.call("is_paused")
        assert not (tmp_path / LORA_DIR).exists()


@pytest.mark.slow
def test_broadcast_transfer_over_gloo_leaves_the_server_with_the_trainers_weights():
    with embedded_server() as server, ClientThread(server.base_url, 60) as client:
        model = lora_model(seed=4)
        # A small buffer: the weights travel in many buckets, each handed over as it fills.
        transfer = BroadcastTransfer(device="cpu", buffer_size_bytes=20_000)
        transfer.connect(client, server.base_url)
        with MergedWeightSync(transfer, client) as sync:
            metrics = sync.sync(model, 1)
            assert metrics["perf/weight_sync_transfer_s"] > 0
            served_weights_equal(server, model)
            assert_generated_by(model, greedy(client))
            randomize_lora(model, seed=5)  # a second sync over the same group
            sync.sync(model, 2)
            served_weights_equal(server, model)
            assert not client.call("is_paused")
        assert transfer.group is None  # leaving `with` closed the group


def test_weight_sync_deltas_reach_the_broadcast_of_the_process_that_sends(tmp_path, caplog):
    # AsyncGRPOConfig.weight_sync_deltas goes to build_weight_sync; only rank 0 sends, so only it encodes.
    def built(deltas: bool, is_main: bool, kind: str = "broadcast") -> Any:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(BroadcastTransfer, "connect", lambda self, server, base_url: None)
            return build_weight_sync(
                WeightSyncPlan(kind, "test"),
                server=types.SimpleNamespace(),  # type: ignore[arg-type]
                is_main=is_main,
                world_size=2,
                output_dir=tmp_path,
                max_staleness=1,
                deltas=deltas,
            )

    assert built(deltas=True, is_main=True).transfer.encoder is not None
    assert built(deltas=False, is_main=True).transfer.encoder is None
    assert built(deltas=True, is_main=False).transfer.encoder is None
    assert "weight_sync_deltas" not in caplog.text
    with caplog.at_level(logging.INFO, logger="harness.weight_sync.plan"):
        built(deltas=True, is_main=True, kind="file")  # said to be unused, not silently dropped
    assert "weight_sync_deltas: not used, the weights reach the server by file" in caplog.text


@pytest.mark.slow
def test_broadcast_deltas_send_changed_elements_and_resend_whole_to_a_server_that_lost_them():
    model = build_tiny_qwen3(seed=7)
    parameters = dict(model.named_parameters())
    whole = sum(merged_manifest(model).nbytes(i) for i in range(len(merged_manifest(model).names)))
    with embedded_server() as server, ClientThread(server.base_url, 60) as client:
        transfer = BroadcastTransfer(device="cpu", buffer_size_bytes=20_000, deltas=True)
        transfer.connect(client, server.base_url)
        with MergedWeightSync(transfer, client) as sync:
            sync.sync(model, 1)  # the first sync: every tensor whole
            assert transfer.last_sent_bytes == whole
            served_weights_equal(server, model)
            with torch.no_grad():  # a few elements of three tensors move
                parameters["model.layers.0.self_attn.q_proj.weight"][2, 3] += 0.5
                parameters["model.layers.1.mlp.down_proj.weight"][0, :5] *= 2
                parameters["model.norm.weight"][7] = -1.0
            metrics = sync.sync(model, 2)
            assert 0 < transfer.last_sent_bytes < whole / 50
            assert metrics["perf/weight_sync_sent_mb"] == pytest.approx(transfer.last_sent_bytes / 2**20)
            served_weights_equal(server, model)
            assert_generated_by(model, greedy(client))
            # The server forgets which weights it holds (as after a restart, or a failed update): it refuses
            # the next delta (409, the broadcast drained), and the trainer sends every tensor whole instead.
            server.state.extra.pop("weights_token")
            with torch.no_grad():
                parameters["model.layers.1.self_attn.o_proj.weight"][1, 1] = 3.0
            sync.sync(model, 3)
            assert transfer.last_sent_bytes > whole
            served_weights_equal(server, model)
            sync.sync(model, 4)  # unchanged weights: headers alone
            assert transfer.last_sent_bytes < 1000
            served_weights_equal(server, model)
            assert_generated_by(model, greedy(client))
            assert not client.call("is_paused")


@pytest.mark.slow
def test_a_failed_merged_sync_raises_and_leaves_the_server_resumed(tmp_path):
    bad = types.SimpleNamespace(
        named_parameters=lambda: iter([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])
    )
    with embedded_server() as server, ClientThread(server.base_url, 60) as client:
        sync = build_weight_sync(
            WeightSyncPlan("file", "test"),
            server=client,
            is_main=True,
            world_size=1,
            output_dir=tmp_path,
            max_staleness=1,
        )
        with pytest.raises(Exception, match="shape"):
            sync.sync(bad, 1)
        assert not client.call("is_paused")
        assert_generated_by(build_tiny_qwen3(), greedy(client))  # nothing was applied


class FailingVllmTransfer:
    """A transfer to vLLM whose send fails midway (vLLM answered /update_weights with a 500)."""

    kind = "broadcast"
    keeps_weights_on_failure = False

    def send(self, server: Any, model: Any, weights: Any, dtype: Any = None) -> None:
        server.call("start_weight_update")
        raise RuntimeError("500 Invalid update_info for NCCLWeightTransferEngine")

    def close(self) -> None:
        pass


def test_a_failed_update_to_vllm_leaves_it_paused_and_says_to_restart_it(fake_vllm_server):
    """Finding 2: vLLM's weights are unusable after an update that failed past /start_weight_update, and
    resuming it kills its engine at the next request; the sync stops the run instead, naming the fix."""
    from harness.weight_sync.strategies import WeightSyncError

    sync = MergedWeightSync(FailingVllmTransfer(), fake_vllm_server)
    with pytest.raises(WeightSyncError, match="restart vLLM") as failed:
        sync.sync(lora_model(), 1)
    assert "Invalid update_info" in str(failed.value)
    routes = [route for route, _ in fake_vllm_server.client.calls]
    assert routes == ["/pause", "/start_weight_update"]  # never /resume, never /finish_weight_update


def test_merged_sync_checks_the_server_before_it_is_paused():
    """Finding 2's check first: a vLLM without the NCCL engine, or too old, is refused at connect, before
    anything is paused or sent."""
    from harness.testing import FakeGenerationServer

    api = types.SimpleNamespace()  # vLLM's classes are never reached
    no_engine = FakeGenerationServer(server_info={"vllm_config": {}}, version="0.32.0")
    with ClientThread(LOCAL, 30.0, client=no_engine) as server:
        with pytest.raises(ValueError, match="--weight-transfer-config"):
            BroadcastTransfer(vllm_api=api).connect(server, LOCAL)
        assert no_engine.calls == []
    old = FakeGenerationServer(server_info=vllm_info(), version="0.20.1")
    with ClientThread(LOCAL, 30.0, client=old) as server:
        with pytest.raises(ValueError, match=r"vLLM >= 0\.26"):
            BroadcastTransfer(vllm_api=api).connect(server, LOCAL)
        assert old.calls == []


def test_a_lora_policy_falling_back_to_merged_sync_warns_and_its_error_names_the_reason(caplog):
    """Finding 4: --max-loras below max_staleness + 2 turns adapter sync into merged sync; that is a
    warning (not an INFO line nobody sees), and when merged sync then cannot start (no vLLM on the trainer)
    its error says why merged sync was chosen."""
    info = vllm_info({"max_loras": 4, "max_lora_rank": 8})
    with caplog.at_level(logging.INFO, logger="harness.weight_sync"):
        plan = plan_weight_sync(lora_model(), info, base_url=LOCAL, max_staleness=4)
    assert plan.kind == "broadcast" and "--max-loras 6" in plan.reason
    (record,) = [r for r in caplog.records if "weight sync:" in r.getMessage()]
    assert record.levelno == logging.WARNING
    if importlib.util.find_spec("vllm") is None:
        from harness.testing import FakeGenerationServer

        fake = FakeGenerationServer(server_info=info, version="0.32.0")
        with ClientThread(LOCAL, 30.0, client=fake) as server, pytest.raises(ImportError) as missing:
            build_weight_sync(
                plan, server=server, is_main=True, world_size=1, output_dir=".", max_staleness=4
            )
        assert "needs vLLM on the trainer too" in str(missing.value) and "--max-loras 6" in str(missing.value)


def test_a_404_on_load_lora_adapter_names_the_environment_variable(tmp_path):
    """Finding 4: vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING answers /v1/load_lora_adapter with 404."""
    from harness.generation.protocol import ServerRequestError
    from harness.testing import FakeGenerationServer
    from harness.weight_sync.strategies import WeightSyncError

    fake = FakeGenerationServer(server_info=vllm_info({"max_loras": 4, "max_lora_rank": 8}))

    async def refuse(body: dict[str, str]) -> None:
        raise ServerRequestError(404, "Not Found")

    fake.before("load_lora_adapter", refuse)
    with ClientThread(LOCAL, 30.0, client=fake) as server:
        sync = AdapterWeightSync(server, tmp_path, window=2)
        with pytest.raises(WeightSyncError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1") as refused:
            sync.sync(lora_model(), 0)
        assert "--api-server-count 1" in str(refused.value)


@pytest.mark.parametrize(
    ("bf16", "served", "warned"),
    [(False, "torch.bfloat16", True), (True, "torch.bfloat16", False), (False, "torch.float32", False)],
)
def test_a_server_in_another_dtype_than_the_trainer_is_warned_about(tmp_path, bf16, served, warned):
    """Finding 6: the trainer's dtype (bf16 from the config, else the model's) against the server's."""
    from harness.training.generation_side import compute_dtype
    from harness.weight_sync.plan import dtype_mismatch

    args = run_config(tmp_path, bf16=bf16, use_cpu=True)
    warning = dtype_mismatch(
        compute_dtype(args, build_tiny_qwen3()), {"vllm_config": {"model_config": {"dtype": served}}}
    )
    assert (warning is not None) == warned
    if warned:
        assert "bfloat16" in warning and "float32" in warning and "--dtype float32" in warning


@pytest.mark.parametrize(
    ("model_dtype", "served", "kind", "expected"),
    [
        (torch.float32, ["torch.bfloat16"], "file", "bfloat16"),
        (torch.float32, ["float16"], "broadcast", "float16"),
        (torch.float32, ["torch.float32"], "ipc", None),  # not narrower
        (torch.bfloat16, ["torch.bfloat16"], "file", None),  # nothing wider to cast
        (torch.float32, ["torch.bfloat16", "torch.float32"], "file", None),  # servers disagree
        (torch.float32, ["torch.bfloat16"], "adapter", None),  # adapters are files of their own
        (torch.float32, [None], "file", None),  # a server that does not say
    ],
)
def test_merged_weights_travel_in_the_servers_dtype_when_it_is_narrower(model_dtype, served, kind, expected):
    from harness.weight_sync.plan import sent_as

    infos = [{"vllm_config": {"model_config": {"dtype": dtype}}} for dtype in served]
    plan = sent_as(build_tiny_qwen3(dtype=model_dtype), infos, WeightSyncPlan(kind, "test"))
    assert plan.send_dtype == expected


class RecordingTransfer:
    """A transport that records what each sync sends (name, dtype, bytes), then hands it to `inner`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.sent: list[tuple[str, torch.dtype, int]] = []

    def send(self, server: Any, model: Any, weights: Any, dtype: Any = None) -> None:
        def recorded() -> Any:
            for name, tensor in weights:
                self.sent.append((name, tensor.dtype, tensor.numel() * tensor.element_size()))
                yield name, tensor

        self.inner.send(server, model, recorded(), dtype)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("lora", [False, True])
def test_a_float32_policy_reaches_a_bf16_server_in_half_the_bytes_and_the_same_weights(lora):
    """Cast before sending, the server holds bit for bit what it holds after rounding float32 on its copy."""
    from harness.weight_sync.transports import FileTransfer

    def bf16_server() -> EmbeddedServer:
        state = ServerState.from_model(
            build_tiny_qwen3(dtype=torch.bfloat16),
            ServerConfig(model="tiny-qwen3", max_model_len=128, max_num_seqs=4),
            tokenizer=build_tiny_tokenizer(),
        )
        return EmbeddedServer(state)

    model = lora_model(seed=6) if lora else build_tiny_qwen3(seed=6)
    served: list[dict[str, torch.Tensor]] = []
    transfers: list[RecordingTransfer] = []
    for send_dtype in (None, torch.bfloat16):
        with bf16_server() as server, ClientThread(server.base_url, 60) as client:
            if send_dtype is not None:
                plan = plan_weight_sync(
                    model, client.server_info(), base_url=server.base_url, max_staleness=1
                )
                assert (plan.kind, plan.send_dtype) == ("file", "bfloat16")
            transfer = RecordingTransfer(FileTransfer())
            with MergedWeightSync(transfer, client, send_dtype=send_dtype) as sync:  # type: ignore[arg-type]
                sync.sync(model, 1)
            served_weights_equal(server, model)
            served.append(
                {n: p.clone() for n, p in server.state.model.named_parameters(remove_duplicate=False)}
            )
            transfers.append(transfer)
    assert served[0].keys() == served[1].keys()
    assert all(torch.equal(served[0][name], served[1][name]) for name in served[0])
    as_float32, as_bf16 = transfers
    assert {dtype for _, dtype, _ in as_float32.sent} == {torch.float32}
    assert {dtype for _, dtype, _ in as_bf16.sent} == {torch.bfloat16}
    assert [name for name, _, _ in as_bf16.sent] == [name for name, _, _ in as_float32.sent]
    assert 2 * sum(n for _, _, n in as_bf16.sent) == sum(n for _, _, n in as_float32.sent)


# --- the trainer --------------------------------------------------------------------------------------------


def conversations(n: int) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(n)]})


def length_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def routed_address() -> str | None:
    """This host's address on its routed interface (not loopback), or None without one."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet leaves: a UDP connect only picks the route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.slow
def test_a_trainer_broadcasting_to_a_server_on_another_address_sends_deltas(tmp_path):
    # The server is reached at this host's routed address, so the trainer takes it for another host's: merged
    # weights are broadcast (gloo), and with weight_sync_deltas each step's sync sends the elements whose bf16
    # value changed (a float32 policy at a small learning rate, a bf16 server).
    from harness import AsyncGRPOTrainer

    address = routed_address()
    if address is None:
        pytest.skip("no network interface but loopback")
    model_dir = tmp_path / "model"
    build_tiny_qwen3().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)
    state = ServerState.from_model(
        build_tiny_qwen3(dtype=torch.bfloat16),
        ServerConfig(model="tiny-qwen3", max_model_len=128, max_num_seqs=16),
        tokenizer=build_tiny_tokenizer(),
    )
    with EmbeddedServer(state, host="0.0.0.0") as server:
        args = run_config(
            tmp_path,
            learning_rate=1e-5,
            max_steps=3,
            generation_server="external",
            vllm_server_base_url=f"http://{address}:{server.port}",
            weight_sync_deltas=True,
            logging_steps=1,
        )
        trainer = AsyncGRPOTrainer(
            str(model_dir), reward_funcs=length_reward, args=args, train_dataset=conversations(8)
        )
        trainer.train()
        assert trainer._weight_sync.kind == "merged-broadcast"
        whole_mb = sum(p.numel() * 2 for p in state.model.parameters()) / 2**20
        sent_mb = [
            e["perf/weight_sync_sent_mb"]
            for e in trainer.state.log_history
            if "perf/weight_sync_sent_mb" in e
        ]
        # The server starts from the checkpoint the trainer loaded: the first sync is the first send, whole.
        assert len(sent_mb) == 3, trainer.state.log_history  # one sync a step
        assert sent_mb[0] == pytest.approx(whole_mb)
        assert all(0 < mb < 0.6 * whole_mb for mb in sent_mb[1:]), (sent_mb, whole_mb)
        served = dict(state.model.named_parameters(remove_duplicate=False))
        for name, parameter in trainer.model.named_parameters():
            assert torch.equal(served[name], parameter.detach().to(torch.bfloat16)), name


@pytest.mark.slow
def test_trainer_with_lora_syncs_adapters_and_the_worker_generates_with_the_newest(tmp_path):
    from harness import AsyncGRPOTrainer

    model_dir = tmp_path / "model"
    build_tiny_qwen3().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)
    with embedded_server(enable_lora=True, max_loras=3, max_lora_rank=8) as server:
        events: list[tuple[str, str]] = []
        manager = server.state.lora
        load, unload = manager.load, manager.unload
        manager.load = lambda name, path: (events.append(("load", name)), load(name, path))[1]
        manager.unload = lambda name: (events.append(("unload", name)), unload(name))[1]
        requested: list[str] = []

        class Recording(dict):
            """The server's adapter table, noting which adapter each generation request names."""

            def get(self, key, default=None):
                requested.append(key)
                return super().get(key, default)

        manager.adapters = Recording(manager.adapters)
        args = run_config(
            tmp_path,
            learning_rate=1e-2,
            generation_server="external",
            vllm_server_base_url=server.base_url,
            logging_steps=1,
        )
        prompts = conversations(8)
        trainer = AsyncGRPOTrainer(
            str(model_dir),
            reward_funcs=length_reward,
            args=args,
            train_dataset=prompts,
            peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )
        output = trainer.train()
        assert output.global_step == 2
        prefix = trainer._weight_sync.adapter_prefix
        assert prefix is not None
        names = [adapter_name(prefix, v) for v in range(3)]
        loads = [n for kind, n in events if kind == "load"]
        assert loads == names  # the start version, then one per sync, never in place
        unloads = [n for kind, n in events if kind == "unload"]
        assert unloads[0] == names[0]  # fell out of the window at the second sync
        assert set(unloads) == set(names)  # the rest when the run ended
        assert server.state.lora.adapters == {}
        assert list((tmp_path / "out" / LORA_DIR).iterdir()) == []
        merged: dict[str, float] = {}
        for entry in trainer.state.log_history:
            merged.update(entry)
        for key in ("perf/weight_sync_s", "perf/weight_sync_transfer_s", "loss"):
            assert key in merged and math.isfinite(merged[key]), key
        # every generation request named an adapter version the trainer had loaded, and the worker moved
        # on to the newer versions as the trainer synced them
        assert requested and set(requested) <= set(names)
        assert names[1] in requested or names[2] in requested


@pytest.mark.slow
def test_trainer_with_lora_and_a_builtin_server_without_lora_falls_back_to_merged(tmp_path, caplog):
    from harness import AsyncGRPOTrainer

    model_dir = tmp_path / "model"
    build_tiny_qwen3().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)
    args = run_config(tmp_path, generation_server="builtin", builtin_server_max_model_len=256)
    trainer = AsyncGRPOTrainer(
        str(model_dir),
        reward_funcs=length_reward,
        args=args,
        train_dataset=conversations(8),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    with caplog.at_level(logging.INFO, logger="harness.weight_sync"):
        assert trainer.train().global_step == 2
    reason = "weight sync: file (merged sync instead of adapter sync: the server has no LoRA support"
    assert reason in caplog.text
    assert trainer._weight_sync.kind == "merged-file"
    merged: dict[str, float] = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    for key in ("perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_transfer_s"):
        assert key in merged and math.isfinite(merged[key]), key
